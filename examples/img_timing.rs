use std::time::Instant;
fn main() {
    let dir = std::path::Path::new(&std::env::args().nth(1).unwrap()).to_path_buf();
    let px = mt::data::QwenVlImages::load(&dir.join("tokenizer")).unwrap();
    let t = Instant::now();
    let mut n = 0;
    for i in 0..16 {
        let p = dir.join(format!("images/{i:02}.png"));
        let t0 = Instant::now();
        let rgb = mt::data::image::decode(&p).unwrap();
        let t1 = t0.elapsed();
        let (_g, rows) = px.pixel_values(&rgb);
        n += rows.len();
        if i == 0 {
            println!("decode {:?} pixel_values {:?}", t1, t0.elapsed() - t1);
        }
    }
    println!("16 images: {:?} ({n} values)", t.elapsed());
}
