//! The switchboard's parsing, and docs/switches.md against [`NAMES`].

use std::collections::{BTreeSet, HashMap};
use std::ffi::OsString;

use super::*;

/// The switches of an environment holding `vars` only.
fn parse(vars: &[(&str, &str)]) -> Result<Switches> {
    let map: HashMap<String, OsString> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), OsString::from(v)))
        .collect();
    Switches::from_lookup(&mut |var| map.get(var).cloned())
}

fn error(vars: &[(&str, &str)]) -> String {
    parse(vars).expect_err("a bad value").to_string()
}

#[test]
fn unset_gives_the_defaults() {
    let s = parse(&[]).unwrap();
    assert!(s.direct_io && s.defer_moments && !s.memory_trace && !s.gated_delta_autograd);
    assert_eq!(s.torch_profile_step, 3);
    assert_eq!(
        (s.gated_delta, s.gated_delta_chunk, s.moe_experts),
        (None, None, None)
    );
    assert_eq!(s.fused, Fused::default());
    assert_eq!(s.testing, testing::Testing::default());
    // An empty value is unset.
    assert_eq!(parse(&[("MT_SIMD", ""), ("MT_DIRECT_IO", "")]).unwrap(), s);
}

#[test]
fn values_parse() {
    let s = parse(&[
        ("MT_GATED_DELTA_CHUNK", "128"),
        ("MT_GATED_DELTA", "chunked"),
        ("MT_GATED_DELTA_RECURRENCE", "autograd"),
        ("MT_DIRECT_IO", "0"),
        ("MT_ROPE", "plain"),
        ("MT_SWIGLU", "fused"),
        ("MT_SIMD", "avx2"),
        ("MT_MEMORY_TRACE", "1"),
        ("MT_TEST_KILL_WORKER", "1:3"),
        ("MT_TEST_FAIL_ALLOC", "forward:2"),
        ("MT_TEST_EXPORT_PAUSE", "renamed:/tmp/flag"),
    ])
    .unwrap();
    assert_eq!(s.gated_delta_chunk, Some(128));
    assert_eq!(s.gated_delta, Some(DeltaRule::Chunked));
    assert!(s.gated_delta_autograd && s.memory_trace && !s.direct_io);
    assert_eq!((s.fused.rope, s.fused.swiglu), (Some(false), Some(true)));
    assert_eq!(s.simd, Some(SimdCeiling::Avx2));
    assert_eq!(s.testing.kill_worker, Some((1, 3)));
    assert_eq!(s.testing.fail_alloc, Some(("forward".into(), Some(2))));
    assert_eq!(
        s.testing.export_pause,
        Some(("renamed".into(), "/tmp/flag".into()))
    );
}

/// Each bad value is one line naming the variable, the value and what it takes.
#[test]
fn bad_values_name_the_variable() {
    let cases: &[(&str, &str, &str)] = &[
        (
            "MT_GATED_DELTA_CHUNK",
            "abc",
            "MT_GATED_DELTA_CHUNK=abc: expected `16`, `32`, `64`, `128` or `256`",
        ),
        (
            "MT_GATED_DELTA_CHUNK",
            "48",
            "MT_GATED_DELTA_CHUNK=48: expected",
        ),
        (
            "MT_GATED_DELTA",
            "fast",
            "MT_GATED_DELTA=fast: expected `reference` or `chunked`",
        ),
        ("MT_ROPE", "on", "MT_ROPE=on: expected `fused` or `plain`"),
        (
            "MT_MOE_EXPERTS",
            "x",
            "MT_MOE_EXPERTS=x: expected `grouped` or `loop`",
        ),
        ("MT_DIRECT_IO", "no", "MT_DIRECT_IO=no: expected `1` or `0`"),
        (
            "MT_CHECKPOINT_STREAMS",
            "0",
            "MT_CHECKPOINT_STREAMS=0: expected a count of threads from 1 to 1024",
        ),
        (
            "MT_TORCH_PROFILE_STEP",
            "0",
            "MT_TORCH_PROFILE_STEP=\"0\": expected a step number from 1",
        ),
        (
            "MT_GATHER_WINDOW",
            "99999999999",
            "MT_GATHER_WINDOW=99999999999: expected a count of elements from 1 to 16777216",
        ),
        (
            "MT_TEST_KILL_WORKER",
            "1",
            "MT_TEST_KILL_WORKER=1: expected <rank>:<step>",
        ),
        (
            "MT_TEST_FAIL_ALLOC",
            "forward:x",
            "MT_TEST_FAIL_ALLOC=forward:x: expected <phase>[:<layer>]",
        ),
        (
            "MT_TEST_EXPORT_PAUSE",
            "renamed",
            "MT_TEST_EXPORT_PAUSE=renamed: expected <instant>:<flag file>",
        ),
        (
            "MT_TEST_HOST_MEMORY",
            "8G",
            "MT_TEST_HOST_MEMORY=8G: expected a count of bytes from 0",
        ),
    ];
    for (var, value, want) in cases {
        let got = error(&[(var, value)]);
        assert!(got.starts_with(want), "{var}={value}: got `{got}`");
        assert!(!got.contains('\n'), "{got}");
    }
}

/// Every variable the parser asks for, and only those, is in [`NAMES`].
#[test]
fn names_list_what_is_read() {
    let mut asked = BTreeSet::new();
    Switches::from_lookup(&mut |var| {
        asked.insert(var.to_string());
        None
    })
    .unwrap();
    let names: BTreeSet<String> = NAMES.iter().map(|n| n.to_string()).collect();
    assert_eq!(asked, names);
    assert_eq!(names.len(), NAMES.len(), "a name listed twice");
}

/// docs/switches.md's table (first column: `` `MT_...` ``) lists exactly [`NAMES`].
#[test]
fn the_doc_table_lists_every_variable() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/switches.md");
    let text = std::fs::read_to_string(&path).unwrap();
    let documented: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once('`'))
        .map(|(name, _)| name.to_string())
        .filter(|n| n.starts_with("MT_"))
        .collect();
    let doc: BTreeSet<&str> = documented.iter().map(String::as_str).collect();
    let code: BTreeSet<&str> = NAMES.iter().copied().collect();
    assert_eq!(doc.len(), documented.len(), "a variable documented twice");
    assert_eq!(
        doc.difference(&code).collect::<Vec<_>>(),
        Vec::<&&str>::new(),
        "documented in docs/switches.md but not read (src/switches.rs NAMES)"
    );
    assert_eq!(
        code.difference(&doc).collect::<Vec<_>>(),
        Vec::<&&str>::new(),
        "read (src/switches.rs NAMES) but missing from docs/switches.md's table"
    );
}
