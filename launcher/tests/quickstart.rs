//! README's quick start, run as it stands, so that the front door cannot rot.
//!
//! README.md marks each block of the quick start with a comment line before it:
//! `<!-- quickstart: download DIR -->` (the hub download: here a tiny model trained for
//! one step and exported stands in for it, under the same directory name),
//! `<!-- quickstart: file PATH -->` (the block is written to PATH), `<!-- quickstart: run -->`
//! (each command line is run from the scratch directory, `target/release/mt-launch` being
//! this build's launcher) and `<!-- quickstart: python -->` (the block runs with `.venv`'s
//! Python). The launch gets [`SMALLER`] appended: the tiny model on CPU stands in for a 7B
//! on a GPU, and a few steps show the same path. Every other word is README's.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// What the stand-in run changes: a few steps, and rows the tiny model's 512 positions hold.
const SMALLER: &[&str] = &[
    "--set",
    "training.num_steps=3",
    "--set",
    "dataset.max_seq_len=256",
    "--set",
    "checkpoint.every_steps=2",
];

/// One marked block of README's quick start.
#[derive(Debug)]
struct Block {
    /// `download`, `file`, `run` or `python`.
    kind: String,
    /// The marker's argument (a directory or file path).
    arg: String,
    body: String,
}

/// The marked blocks of README.md, in order.
fn blocks(readme: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut lines = readme.lines();
    while let Some(line) = lines.next() {
        let Some(marker) = line
            .trim()
            .strip_prefix("<!-- quickstart:")
            .and_then(|m| m.strip_suffix("-->"))
        else {
            continue;
        };
        let mut words = marker.split_whitespace();
        let kind = words
            .next()
            .expect("a quickstart marker names its kind")
            .to_string();
        let arg = words.collect::<Vec<_>>().join(" ");
        let fence = lines.next().expect("a fenced block follows the marker");
        assert!(
            fence.starts_with("```"),
            "{kind} marker not followed by a fence: {fence}"
        );
        let body: Vec<&str> = lines
            .by_ref()
            .take_while(|l| !l.starts_with("```"))
            .collect();
        out.push(Block {
            kind,
            arg,
            body: body.join("\n") + "\n",
        });
    }
    out
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn the_quick_start_runs_as_written() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let blocks = blocks(&readme);
    let kinds: Vec<&str> = blocks.iter().map(|b| b.kind.as_str()).collect();
    assert_eq!(
        kinds,
        ["download", "file", "file", "run", "python"],
        "README's quick start blocks changed: update this test with them"
    );
    let work = scratch("quickstart");
    let python = repo().join(".venv/bin/python");
    let mut output_dirs = Vec::new();
    for block in &blocks {
        match block.kind.as_str() {
            "download" => {
                assert!(
                    block.body.contains(&block.arg),
                    "the download writes where its marker says: {}",
                    block.body
                );
                tiny_pretrained(&work.join(&block.arg));
            }
            "file" => {
                let path = work.join(&block.arg);
                std::fs::create_dir_all(path.parent().unwrap()).unwrap();
                std::fs::write(&path, &block.body).unwrap();
                if block.arg.ends_with(".yaml") {
                    let cfg: serde_json::Value = serde_yaml_ng::from_str(&block.body).unwrap();
                    let out = cfg["training"]["output_dir"].as_str().unwrap();
                    output_dirs.push(work.join(out));
                }
            }
            "run" => {
                for line in block.body.lines().map(str::trim) {
                    if line.is_empty() || line.starts_with('#') {
                        continue;
                    }
                    let words: Vec<&str> = line.split_whitespace().collect();
                    assert_eq!(
                        words[0], "target/release/mt-launch",
                        "quick start commands run the built launcher"
                    );
                    let mut args: Vec<&str> = words[1..].to_vec();
                    if args[0] != "plan" {
                        args.extend_from_slice(SMALLER);
                    }
                    let out = Command::new(launcher())
                        .args(&args)
                        .current_dir(&work)
                        .output()
                        .unwrap();
                    assert_ok(&out, &args);
                    if args[0] == "plan" {
                        let text = String::from_utf8_lossy(&out.stdout);
                        assert!(
                            text.contains("host memory"),
                            "plan printed its plan:\n{text}"
                        );
                    }
                }
            }
            "python" => {
                if !python.is_file() {
                    eprintln!(
                        "SKIPPED: no .venv/bin/python (run scripts/setup.sh): the result is not loaded"
                    );
                    continue;
                }
                let script = work.join("use_the_result.py");
                std::fs::write(&script, &block.body).unwrap();
                let out = Command::new(&python)
                    .arg(&script)
                    .current_dir(&work)
                    .output()
                    .unwrap();
                assert!(
                    out.status.success(),
                    "README's python block failed:\n{}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            other => panic!("unknown quickstart block kind {other}"),
        }
    }
    for dir in &output_dirs {
        assert!(
            dir.join("model.safetensors").is_file() && dir.join("config.json").is_file(),
            "the model was written to {}",
            dir.display()
        );
    }
    let ck = work.join("output/qwen2.5-7b-sft-checkpoints");
    assert!(
        std::fs::read_dir(&ck)
            .map(|d| d
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("step-")))
            .unwrap_or(false),
        "checkpoints were written under {}",
        ck.display()
    );
    assert!(
        work.join("output/qwen2.5-7b-sft.svg").is_file(),
        "the picture of the run"
    );
}
