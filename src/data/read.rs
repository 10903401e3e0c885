//! Records to rows: each file's records read in parallel ([`read_all`]), each record turned
//! into its row (or a preference pair's two, [`super::pairs`]) by the chat template or as
//! token ids, checked against the vocabulary and fitted to `dataset.max_seq_len`; bad
//! records skipped and counted, or errors under `dataset.strict`.

use rayon::prelude::*;

use super::files::FileRecords;
use super::records::{self, BadRecord, Conversation, RawRecord};
use super::sources::Source;
use super::{
    ChatTokenizer, Example, Gemma3Images, LlavaNextImages, QwenVlImages, Skipped, chat, pairs,
    tokenized,
};
use crate::cancel;
use crate::config::{DatasetSection, Overlong, Stage};
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// Reasons of the first skipped records kept for the report.
const REPORTED_SKIPS: usize = 5;

/// What every record of a load is read with.
pub(super) struct Reader<'a> {
    pub(super) ds: &'a DatasetSection,
    pub(super) stage: Stage,
    pub(super) chat: Option<&'a ChatTokenizer>,
    pub(super) vocab: usize,
    /// What the model makes of a record's images.
    pub(super) images: &'a Images,
}

/// What a model makes of images in the records.
#[derive(Debug)]
pub enum Images {
    /// A text-only model: a record with images is refused.
    TextOnly,
    /// A vision-language model whose directory has no `preprocessor_config.json` (the
    /// path): a record with images is refused, naming it.
    NoProcessor(PathBuf),
    /// A Qwen2-VL-style model: `<image>` expanded to the image's tokens, the image carried
    /// to the workers.
    Qwen(QwenVlImages),
    /// A Gemma 3 model: `<image>` expanded to its fixed image sequence after the template.
    Gemma3(Gemma3Images),
    /// A LLaVA-NeXT model: `<image>` expanded after the template to its image's count.
    LlavaNext(LlavaNextImages),
}

/// How the workers turn an image file into the tower's pixels, by family.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum ImageProcessor {
    Qwen(QwenVlImages),
    Gemma3(Gemma3Images),
    LlavaNext(LlavaNextImages),
}

impl Images {
    /// What `model_dir`'s model makes of images: a vision-language model's image
    /// processor settings (`preprocessor_config.json`), or text only.
    pub fn of_model(model_dir: &Path) -> Result<Images> {
        // A tokenizer's directory without a model config (data tooling) reads text.
        use crate::config::vision::TowerSpec;
        if !model_dir.join("config.json").is_file() {
            return Ok(Images::TextOnly);
        }
        let Some(tower) = TowerSpec::from_model_dir(model_dir)? else {
            return Ok(Images::TextOnly);
        };
        let path = model_dir.join("preprocessor_config.json");
        match (path.exists(), tower) {
            (false, _) => Ok(Images::NoProcessor(path)),
            (true, TowerSpec::Qwen(_)) => QwenVlImages::load(model_dir).map(Images::Qwen),
            (true, TowerSpec::Siglip(spec)) => {
                Gemma3Images::load(model_dir, &spec).map(Images::Gemma3)
            }
            (true, TowerSpec::Clip(spec)) => {
                LlavaNextImages::load(model_dir, &spec).map(Images::LlavaNext)
            }
        }
    }

    /// What the workers read image files with, for a model that takes images.
    pub fn processor(self) -> Option<ImageProcessor> {
        match self {
            Images::Qwen(s) => Some(ImageProcessor::Qwen(s)),
            Images::Gemma3(s) => Some(ImageProcessor::Gemma3(s)),
            Images::LlavaNext(s) => Some(ImageProcessor::LlavaNext(s)),
            Images::TextOnly | Images::NoProcessor(_) => None,
        }
    }
}

impl ImageProcessor {
    /// The image tokens `image` takes in its row (the count its `<image>` was expanded to).
    pub fn image_tokens(&self, image: &super::RowImage) -> u64 {
        let [t, h, w] = image.grid.map(u64::from);
        match self {
            // The patch grid, merged merge x merge to a token.
            ImageProcessor::Qwen(q) => t * h * w / u64::from(q.merge_size).pow(2),
            ImageProcessor::Gemma3(g) => g.tokens_per_image as u64,
            // (1, height, width) in pixels.
            ImageProcessor::LlavaNext(l) => l.spec.image_tokens(h as u32, w as u32) as u64,
        }
    }

    /// The image in the file at `path` as a row carries it: its size read from its header,
    /// its grid as this processor resizes it (an error where the processor refuses the
    /// size, e.g. past Qwen's `max_pixels` bound of its aspect).
    pub fn row_image(&self, path: &Path) -> Result<super::RowImage, String> {
        let size = super::image::read_size(path)?;
        let grid = match self {
            ImageProcessor::Qwen(q) => {
                let g = q.grid(size.height, size.width)?;
                [g.t, g.h, g.w]
            }
            ImageProcessor::Gemma3(g) => g.grid(),
            ImageProcessor::LlavaNext(_) => super::LlavaNextImages::grid(size.height, size.width),
        };
        Ok(super::RowImage {
            path: path.to_path_buf(),
            grid,
        })
    }

    /// Whether the tokens of id `token_id` in `ids` are `images`' tokens, in order: each run
    /// of them one image's count ([`ImageProcessor::image_tokens`]), or, where the model
    /// takes images side by side (Gemma 3, LLaVA-NeXT: no Qwen 3-D positions to place per
    /// image), several consecutive images'. The error says what was found.
    pub fn check_row(
        &self,
        ids: &[i32],
        token_id: i64,
        images: &[super::RowImage],
    ) -> Result<(), String> {
        let counts: Vec<u64> = images.iter().map(|im| self.image_tokens(im)).collect();
        let side_by_side = !matches!(self, ImageProcessor::Qwen(_));
        let mut runs = Vec::new();
        let mut i = 0;
        while i < ids.len() {
            let run = ids[i..]
                .iter()
                .take_while(|&&t| i64::from(t) == token_id)
                .count();
            if run > 0 {
                runs.push((i, run as u64));
            }
            i += run.max(1);
        }
        let mut next = 0;
        for &(at, run) in &runs {
            let mut covered = 0;
            let first = next;
            while covered < run && next < counts.len() && (covered == 0 || side_by_side) {
                covered += counts[next];
                next += 1;
            }
            if covered != run {
                let these = &counts[first..next];
                return Err(match these {
                    [] => format!(
                        "{run} image tokens at {at} but the row's {} images ({} tokens) are placed before them",
                        counts.len(),
                        counts.iter().sum::<u64>()
                    ),
                    _ => format!(
                        "{run} image tokens at {at} where image {first} takes {} (the images' token counts: {counts:?}; expand each image to its count, as the model's processor does)",
                        these.iter().sum::<u64>()
                    ),
                });
            }
        }
        match next == counts.len() {
            true => Ok(()),
            false => Err(format!(
                "{} images ({} tokens) but {} image tokens in the row: every image needs its tokens in the ids (token id {token_id})",
                counts.len(),
                counts.iter().sum::<u64>(),
                runs.iter().map(|r| r.1).sum::<u64>()
            )),
        }
    }

    /// The most image tokens one row of `rows` holds; None where there are no rows (a
    /// dataset `mt-launch plan` did not read, a server's), so that a bound on the images
    /// of a micro-batch must come from its tokens.
    pub fn most_per_row<'a>(
        &self,
        rows: impl IntoIterator<Item = &'a super::Example>,
    ) -> Option<u64> {
        rows.into_iter()
            .map(|r| r.images.iter().map(|im| self.image_tokens(im)).sum())
            .max()
    }
}

impl Reader<'_> {
    /// `pt` documents are cut into blocks after reading, so each is kept whole.
    pub(super) fn pt_blocks(&self) -> bool {
        self.stage == Stage::Pt && self.ds.packing
    }
}

/// Samples read from sources.
#[derive(Default)]
pub(super) struct Read {
    pub(super) files: Vec<PathBuf>,
    pub(super) rows: Vec<Example>,
    pub(super) skipped: Skipped,
}

/// Reads every file of `srcs`; at least one usable record must come out.
pub(super) fn read_all(srcs: &[Source], reader: &Reader) -> Result<Read> {
    let ds = reader.ds;
    let mut out = Read::default();
    for src in srcs {
        let mut left = src
            .limit
            .unwrap_or(usize::MAX)
            .min(ds.max_samples.unwrap_or(usize::MAX));
        for file in &src.files {
            cancel::check(cancel::DATA)?;
            let contents = FileRecords::read(file)?;
            cancel::check(cancel::DATA)?;
            let mut recs = contents.records()?;
            recs.truncate(left);
            left -= recs.len();
            // Each record checks for a stop request, and a template past its bounds stops
            // the load: rayon's collect into a Result ends the other threads' work early.
            let rows: Vec<std::result::Result<Vec<Example>, BadRecord>> = recs
                .par_iter()
                .map(|rec| {
                    cancel::check(cancel::DATA)?;
                    match rows(src, rec, reader) {
                        Err(bad) if bad.fatal => Err(contents.error(bad)),
                        r => Ok(r),
                    }
                })
                .collect::<Result<_>>()?;
            for r in rows {
                match r {
                    Ok(ex) => out.rows.extend(ex),
                    Err(bad) if ds.strict => return Err(contents.error(bad)),
                    Err(bad) => {
                        let s = &mut out.skipped;
                        s.count += 1;
                        if s.first.len() < REPORTED_SKIPS {
                            s.first.push(format!(
                                "{}: field `{}`: {}",
                                contents.locate(&bad),
                                bad.field,
                                bad.reason
                            ));
                        }
                    }
                }
            }
            out.files.push(file.clone());
        }
    }
    if out.rows.is_empty() {
        return Err(Error::DatasetFile {
            path: out.files.first().cloned().unwrap_or_default(),
            msg: match out.skipped.count {
                0 => "no usable records (it holds none)".into(),
                n => format!(
                    "no usable records ({n} skipped; first: {})",
                    out.skipped.first.join("; ")
                ),
            },
        });
    }
    Ok(out)
}

/// One record's rows: one, or a preference pair's two under `dpo` ([`pairs`]).
fn rows(
    src: &Source,
    rec: &RawRecord,
    reader: &Reader,
) -> std::result::Result<Vec<Example>, BadRecord> {
    match reader.stage {
        Stage::Dpo => pairs::pair(src, rec, reader).map(Vec::from),
        _ => row(src, rec, reader).map(|r| vec![r]),
    }
}

/// A conversation with tool calls needs a chat template that renders them; else the record
/// is bad, named by its `column`.
pub(super) fn renders_tools(
    chat: &ChatTokenizer,
    conv: &Conversation,
    rec: &RawRecord,
    column: &str,
) -> std::result::Result<(), BadRecord> {
    if chat.supports_tools() || conv.messages.iter().all(|m| m.tool_calls.is_empty()) {
        return Ok(());
    }
    Err(BadRecord::new(
        rec.line,
        column,
        format!(
            "a function_call turn, but the chat template ({}) does not render tool calls",
            chat.template
        ),
    ))
}

/// A record with images is refused, fatally (every record of the dataset would be), where
/// its images cannot be trained: `why` says why (a text-only model, a model directory
/// without its image processor's settings, a preference pair).
pub(super) fn no_images(
    conv: &Conversation,
    rec: &RawRecord,
    schema: &records::Schema,
    why: &str,
) -> std::result::Result<(), BadRecord> {
    let (Some(col), false) = (&schema.columns.images, conv.images.is_empty()) else {
        return Ok(());
    };
    Err(BadRecord {
        fatal: true,
        ..BadRecord::new(
            rec.line,
            col,
            format!("{} images, but {why}", conv.images.len()),
        )
    })
}

/// The reason `images` cannot train a record's images, if any.
pub(super) fn why_no_images(images: &Images) -> Option<String> {
    match images {
        Images::Qwen(_) | Images::Gemma3(_) | Images::LlavaNext(_) => None,
        Images::TextOnly => Some(format!(
            "the model is text-only: train a vision-language model ({}) or leave the `images` column out of the dataset's `columns`",
            crate::config::vision::VISION_MODEL_TYPES.join(", ")
        )),
        Images::NoProcessor(path) => Some(format!(
            "the model's image processor settings are missing: {} (copy it from the model's hub repository)",
            path.display()
        )),
    }
}

/// One record to a row, with `max_seq_len` applied (but to `pt` documents that are cut
/// into blocks later).
fn row(src: &Source, rec: &RawRecord, reader: &Reader) -> std::result::Result<Example, BadRecord> {
    let ds = reader.ds;
    let ex = match (&src.schema, reader.chat) {
        (Some(schema), Some(chat)) => {
            let ex = match reader.stage {
                Stage::Pt => {
                    let text = schema.document(rec)?;
                    chat.document(&text, !ds.packing)
                        .map_err(chat::RenderError::from)
                }
                _ => {
                    let conv = schema.conversation(rec)?;
                    if let Some(why) = why_no_images(reader.images) {
                        no_images(&conv, rec, schema, &why)?;
                    }
                    renders_tools(chat, &conv, rec, &schema.columns.messages)?;
                    match reader.images {
                        Images::Qwen(im) if !conv.images.is_empty() => {
                            im.example(chat, &conv, ds.train_on_prompt)
                        }
                        Images::Gemma3(im) if !conv.images.is_empty() => {
                            im.example(chat, &conv, ds.train_on_prompt)
                        }
                        Images::LlavaNext(im) if !conv.images.is_empty() => {
                            im.example(chat, &conv, ds.train_on_prompt)
                        }
                        _ => chat.example(&conv, ds.train_on_prompt),
                    }
                }
            }
            .map_err(|e| BadRecord::render(rec.line, "", e))?;
            in_vocab(ex, reader.vocab, rec.line)?
        }
        _ => tokenized::example(rec, reader.vocab)?,
    };
    fit(ex, reader, rec.line, src.schema.is_some())
}

/// `ex` if every id is in the model's vocabulary.
pub(super) fn in_vocab(
    ex: Example,
    vocab: usize,
    line: usize,
) -> std::result::Result<Example, BadRecord> {
    match ex.input_ids.iter().find(|&&id| id as usize >= vocab) {
        Some(&bad) => Err(BadRecord::new(
            line,
            "",
            format!("token id {bad} is outside the model's vocabulary 0..{vocab}"),
        )),
        None => Ok(ex),
    }
}

/// `dataset.max_seq_len` applied to a row (`overlong`); a text row must keep a trained
/// token.
pub(super) fn fit(
    mut ex: Example,
    reader: &Reader,
    line: usize,
    text: bool,
) -> std::result::Result<Example, BadRecord> {
    let len = ex.input_ids.len();
    match reader.ds.max_seq_len {
        _ if reader.pt_blocks() => {}
        // Cutting a row's image tokens would leave images without their tokens.
        Some(max) if len > max && !ex.images.is_empty() => {
            return Err(BadRecord::new(
                line,
                "",
                format!(
                    "{len} tokens with the tokens of {} images, longer than dataset.max_seq_len ({max}): a row with images is not truncated",
                    ex.images.len()
                ),
            ));
        }
        Some(max) if len > max && reader.ds.overlong == Overlong::Skip => {
            return Err(BadRecord::new(
                line,
                "",
                format!("{len} tokens, longer than dataset.max_seq_len ({max})"),
            ));
        }
        Some(max) if len > max => {
            ex.input_ids.truncate(max);
            ex.labels.truncate(max);
            if ex.label_tokens() == 0 {
                return Err(BadRecord::new(
                    line,
                    "",
                    format!(
                        "{len} tokens: no trained token left within dataset.max_seq_len ({max})"
                    ),
                ));
            }
        }
        _ => {}
    }
    if text && ex.label_tokens() == 0 {
        return Err(BadRecord::new(line, "", "no trained token"));
    }
    Ok(ex)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::RowImage;

    #[test]
    fn rows_with_images_are_not_truncated() {
        let ds: DatasetSection =
            serde_yaml_ng::from_str("{format: tokenized, path: x.jsonl, max_seq_len: 3}").unwrap();
        let reader = Reader {
            ds: &ds,
            stage: Stage::Sft,
            chat: None,
            vocab: 50,
            images: &Images::TextOnly,
        };
        let ex = Example {
            input_ids: vec![1, 2, 3, 4, 5],
            labels: vec![1, 2, 3, 4, 5],
            ..Example::default()
        };
        assert_eq!(
            fit(ex.clone(), &reader, 7, true).unwrap().input_ids,
            [1, 2, 3]
        );
        let with_image = Example {
            images: vec![RowImage {
                path: "a.png".into(),
                grid: [1, 2, 2],
            }],
            ..ex
        };
        let e = fit(with_image, &reader, 7, true).unwrap_err();
        assert_eq!(e.line, 7);
        assert!(e.reason.contains("not truncated"), "{}", e.reason);
    }
}

#[cfg(test)]
mod image_rows {
    use super::*;
    use crate::data::RowImage;

    fn image(grid: [u32; 3]) -> RowImage {
        RowImage {
            path: "a.png".into(),
            grid,
        }
    }

    /// Qwen: one image per run of image tokens (its 3-D positions are placed per run);
    /// Gemma 3: images side by side may share a run. Each wrong count is named.
    #[test]
    fn a_rows_image_tokens_must_be_its_images() {
        let qwen = ImageProcessor::Qwen(QwenVlImages::default());
        let (four, two) = (image([1, 4, 4]), image([1, 2, 4]));
        assert_eq!((qwen.image_tokens(&four), qwen.image_tokens(&two)), (4, 2));
        let row = |runs: &[usize]| {
            let mut ids = vec![1];
            for &n in runs {
                ids.extend(std::iter::repeat_n(9, n));
                ids.push(1);
            }
            ids
        };
        let pair = [four.clone(), two.clone()];
        assert_eq!(qwen.check_row(&row(&[4, 2]), 9, &pair), Ok(()));
        assert_eq!(qwen.check_row(&row(&[]), 9, &[]), Ok(()));
        for (runs, images, says) in [
            (
                &[2, 4][..],
                &pair[..],
                "2 image tokens at 1 where image 0 takes 4",
            ),
            (&[6], &pair, "6 image tokens at 1 where image 0 takes 4"),
            (&[4], &pair, "2 images (6 tokens) but 4 image tokens"),
            (
                &[4, 2, 2],
                &pair,
                "2 image tokens at 9 but the row's 2 images",
            ),
            (&[4], &[], "4 image tokens at 1 but the row's 0 images"),
        ] {
            let e = qwen.check_row(&row(runs), 9, images).unwrap_err();
            assert!(e.contains(says), "{runs:?}: {e}");
        }
        let gemma = ImageProcessor::Gemma3(Gemma3Images {
            height: 8,
            width: 8,
            patch_size: 2,
            do_rescale: true,
            rescale_factor: 1.0 / 255.0,
            do_normalize: false,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
            tokens_per_image: 3,
            image_token_id: 9,
        });
        let three = [image([1, 4, 4]), image([1, 4, 4])];
        assert_eq!(gemma.check_row(&row(&[6]), 9, &three), Ok(()));
        assert_eq!(gemma.check_row(&row(&[3, 3]), 9, &three), Ok(()));
        assert!(gemma.check_row(&row(&[5]), 9, &three).is_err());
    }
}
