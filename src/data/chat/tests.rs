//! The render bounds ([`super::limits`]) against real templates: the fuel they take, and
//! what a template past a bound gives.

use std::path::{Path, PathBuf};

use super::*;

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/tiny")
}

/// A model directory: the tiny tokenizer with `template` as chat_template.jinja.
fn with_template(name: &str, template: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mt-chat-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tiny().join(f), dir.join(f)).unwrap();
    }
    std::fs::write(dir.join("chat_template.jinja"), template).unwrap();
    dir
}

/// A system prompt, then `turns` user / assistant exchanges.
fn conversation(turns: usize, tools: bool) -> Conversation {
    let mut messages = vec![Message::new(Role::System, "You are terse.")];
    for i in 0..turns {
        messages.push(Message::new(Role::User, format!("What is {i} + {i}?")));
        messages.push(Message::new(Role::Assistant, format!("{}", 2 * i)));
    }
    let tools = tools.then(|| {
        serde_json::from_value::<Value>(serde_json::json!([
            {"type": "function", "function": {"name": "add", "description": "Adds.",
             "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
            {"type": "function", "function": {"name": "now", "description": "The time.",
             "parameters": {"type": "object", "properties": {}}}}
        ]))
        .unwrap()
    });
    Conversation {
        messages,
        tools,
        images: Vec::new(),
    }
}

/// The fuel one render of `conv` takes with the model directory `dir`'s template, or
/// the built-in one `builtin` names.
fn fuel(dir: &Path, builtin: Option<&str>, conv: &Conversation) -> u64 {
    let chat = ChatTokenizer::load(dir, builtin.map(Path::new), false).unwrap();
    let (_, used) = chat
        .render_counted(conv, conv.messages.len(), false)
        .unwrap();
    used
}

#[test]
fn real_templates_take_a_small_share_of_the_fuel() {
    // The tiny demo template and the built-in ones always; the public templates of the
    // tool-calling fixtures (scripts/fixture_templates.py) where the data fixtures were
    // generated.
    let mut dirs = vec![tiny()];
    if let Some(fx) = std::env::var_os("MT_DATA_FIXTURES").map(PathBuf::from) {
        dirs.extend(
            ["qwen25", "llama31", "mistral"]
                .iter()
                .map(|m| fx.join(format!("model-{m}")))
                .filter(|d| d.is_dir()),
        );
    }
    // The built-in templates, rendered with the tiny tokenizer (their tokens unchecked).
    let cases = dirs
        .iter()
        .map(|d| (d.clone(), None))
        .chain(builtin::BUILTINS.iter().map(|b| (tiny(), Some(b.name))));
    for (dir, builtin) in cases {
        let dir = &dir;
        let small = fuel(dir, builtin, &conversation(1, true));
        let long = fuel(dir, builtin, &conversation(200, true));
        let per_message = (long - small) / 400;
        eprintln!(
            "{} {builtin:?}: {small} instructions for 3 messages, {per_message} per message more",
            dir.display()
        );
        // 401 messages must stay under a hundredth of the bound: conversations of
        // 40,000 messages render with the costliest of these templates.
        assert!(
            long * 100 < limits::TEMPLATE_FUEL,
            "{}: {long} instructions for 401 messages",
            dir.display()
        );
        assert!(per_message > 0, "{}: the fuel is counted", dir.display());
    }
}

#[test]
fn a_looping_template_fails_at_its_bound_and_a_slow_one_renders() {
    let looping = with_template(
        "loop",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
    );
    let chat = ChatTokenizer::from_model_dir(&looping, true).unwrap();
    let t0 = std::time::Instant::now();
    let e = chat.example(&conversation(1, false), false).unwrap_err();
    let RenderError::Limit(msg) = e else {
        panic!("a bound, not a bad record: {e}")
    };
    assert!(
        msg.contains("chat_template.jinja") && msg.contains("5000000 template instructions"),
        "{msg}"
    );
    eprintln!("out of fuel after {:.2} s", t0.elapsed().as_secs_f64());
    // A loop of 100,000 steps is within the bound.
    let slow = with_template(
        "slow",
        "{% for i in range(100000) %}{% endfor %}{{ messages[0].content }}",
    );
    let chat = ChatTokenizer::from_model_dir(&slow, true).unwrap();
    assert_eq!(
        chat.render(&conversation(1, false), 1, false).unwrap(),
        "You are terse."
    );
    let huge = with_template(
        "huge",
        "{% for i in range(100) %}{{ 'x' * 1000000 }}{% endfor %}",
    );
    let chat = ChatTokenizer::from_model_dir(&huge, true).unwrap();
    let e = chat.render(&conversation(1, false), 1, false).unwrap_err();
    assert!(
        matches!(&e, RenderError::Limit(m) if m.contains("more than 64 MiB")),
        "{e:?}"
    );
    for d in [looping, slow, huge] {
        std::fs::remove_dir_all(d).unwrap();
    }
}
