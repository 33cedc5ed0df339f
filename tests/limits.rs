//! Every count from a configuration, a profile, a workload or a flag is bounded before anything
//! is sized or measured by it (issue 23): each reproducer of the issue through the binary or
//! the library gets an error naming the file and the key, or the flag, within two seconds
//! (or a sane result), never a panic, an abort or a hang. Counts of a model: `models::limits`;
//! figures of a profile: `Cluster::validate`; special and huge files: `io::read_limited`.

use metashard::Error;
use metashard::io::{GgufValue, GgufWriter};
use metashard::planner::evaluate::Workload;
use metashard::planner::{Cluster, ModelShape, auto};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// What a reproducer must finish within.
const BOUND: Duration = Duration::from_secs(2);

/// A scratch folder unique to this process and `name`, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let d =
            std::env::temp_dir().join(format!("metashard-limits-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }
    fn file(&self, name: &str, text: &str) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the binary with `args`; (exit code, stderr, seconds, stdout). A run longer than 60 s
/// is killed and fails the test (a hang).
fn metashard(args: &[&str]) -> (i32, String, f64, String) {
    let start = Instant::now();
    let mut child = Command::new(env!("CARGO_BIN_EXE_metashard"))
        .args(args)
        .env_remove("METASHARD_MAX_THREADS")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("metashard {args:?} hangs");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let o = child.wait_with_output().unwrap();
    let secs = start.elapsed().as_secs_f64();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    (o.status.code().unwrap_or(-1), err, secs, out)
}

/// The run fails within [`BOUND`] with one error line holding every needle, and no panic.
fn refused(args: &[&str], needles: &[&str]) -> String {
    let (code, err, secs, _) = metashard(args);
    assert_eq!(code, 1, "{args:?}: exit {code}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    for n in needles {
        assert!(err.contains(n), "{args:?}: no {n:?} in: {err}");
    }
    assert!(secs < BOUND.as_secs_f64(), "{args:?} took {secs:.2} s");
    err
}

/// SmolLM2-135M's config.json with `changes`.
fn config(changes: Value) -> String {
    let mut c = json!({
        "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30,
        "vocab_size": 49152, "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
        "tie_word_embeddings": true
    });
    for (k, v) in changes.as_object().unwrap() {
        c[k] = v.clone();
    }
    c.to_string()
}

#[test]
fn huge_counts_in_a_config_json_are_refused_naming_the_key() {
    let s = Scratch::new("config");
    let huge = [
        (
            json!({"num_hidden_layers": 2147483647u64}),
            "'num_hidden_layers'",
        ),
        (
            json!({"num_hidden_layers": 4294967296u64}),
            "'num_hidden_layers'",
        ),
        (
            json!({"num_hidden_layers": 2000000000u64}),
            "'num_hidden_layers'",
        ),
        (
            json!({"num_hidden_layers": 9223372036854775808u64}),
            "'num_hidden_layers'",
        ),
        (json!({"num_hidden_layers": 1000000}), "'num_hidden_layers'"),
        (
            json!({"num_hidden_layers": 100000, "hidden_size": 16384, "intermediate_size": 65536,
                   "num_attention_heads": 128, "num_key_value_heads": 8}),
            "'num_hidden_layers'",
        ),
        (json!({"num_hidden_layers": 0}), "'num_hidden_layers'"),
        (json!({"hidden_size": 1u64 << 40}), "'hidden_size'"),
        (
            json!({"intermediate_size": 1u64 << 33}),
            "'intermediate_size'",
        ),
        (json!({"vocab_size": 1u64 << 40}), "'vocab_size'"),
        (
            json!({"num_attention_heads": 1u64 << 20}),
            "'num_attention_heads'",
        ),
        (
            json!({"num_attention_heads": 7}),
            "'hidden_size' and 'num_attention_heads'",
        ),
        (json!({"num_key_value_heads": 2}), "'num_key_value_heads'"),
        (json!({"num_key_value_heads": 27}), "'num_key_value_heads'"),
        (
            json!({"hidden_size": 262144, "num_attention_heads": 2}),
            "'num_attention_heads'",
        ),
        (
            json!({"max_position_embeddings": 1u64 << 40}),
            "'max_position_embeddings'",
        ),
        (json!({"num_hidden_layers": -3}), "'num_hidden_layers'"),
        (json!({"num_hidden_layers": 1e300}), "'num_hidden_layers'"),
        (json!({"num_hidden_layers": "30"}), "'num_hidden_layers'"),
        (json!({"rms_norm_eps": -1.0}), "'rms_norm_eps'"),
        (json!({"rope_theta": 1e300}), "'rope_theta'"),
        // Every count in bounds, the whole over 2^48 parameters.
        (
            json!({"num_hidden_layers": 1024, "hidden_size": 262144, "intermediate_size": 1048576,
                   "num_attention_heads": 256, "num_key_value_heads": 8, "vocab_size": 4194304}),
            "2^48",
        ),
    ];
    for (i, (change, key)) in huge.iter().enumerate() {
        let path = s.file(&format!("c{i}.json"), &config(change.clone()));
        let p = path.to_str().unwrap();
        refused(
            &["plan", "--model", p, "--cluster", "h100x8-nvswitch"],
            &[p, key],
        );
        // The library says the same, naming the file.
        let e = ModelShape::from_config_json(&path).unwrap_err().to_string();
        assert!(e.contains(p) && e.contains(key), "{change}: {e}");
    }
    // The largest counts accepted plan within seconds (the planner's work is bounded by them).
    let path = s.file(
        "max.json",
        &config(json!({"num_hidden_layers": 1024, "hidden_size": 16384,
                       "intermediate_size": 65536, "num_attention_heads": 128,
                       "num_key_value_heads": 8, "vocab_size": 262144})),
    );
    let shape = ModelShape::from_config_json(&path).unwrap();
    assert_eq!(shape.n_layer(), 1024);
}

#[test]
fn a_shape_built_by_hand_is_checked_before_the_planner_sizes_anything() {
    let mut shape = ModelShape::preset("smollm2-135m").unwrap();
    shape.cfg.n_layer = usize::MAX;
    let start = Instant::now();
    let c = Cluster::preset("h100x8-nvswitch").unwrap();
    let e = auto(&shape, &c, &Workload::default(), None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("num_hidden_layers") && e.contains("smollm2-135m"),
        "{e}"
    );
    let e = metashard::planner::evaluate_layer_split(&shape, &c, &Workload::default(), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("num_hidden_layers"), "{e}");
    assert!(start.elapsed() < BOUND);
    // Every preset is within the bounds.
    for name in ModelShape::PRESETS {
        ModelShape::preset(name).unwrap().check().unwrap();
    }
}

/// A GGUF header declaring `blocks` blocks, holding a `blk.{blocks-1}` tensor (and the few the
/// loader measures the counts against).
fn gguf_with_blocks(blocks: u32) -> Vec<u8> {
    let mut w = GgufWriter::new();
    let s = |x: &str| GgufValue::String(x.into());
    w.add("general.architecture", s("llama"));
    w.add("llama.block_count", GgufValue::U32(blocks));
    w.add("llama.embedding_length", GgufValue::U32(64));
    w.add("llama.feed_forward_length", GgufValue::U32(128));
    w.add("llama.attention.head_count", GgufValue::U32(4));
    w.add("llama.vocab_size", GgufValue::U32(300));
    let f32s = |n: usize| vec![0u8; 4 * n];
    let t = metashard::DType::F32;
    w.add_tensor("token_embd.weight", t, &[64, 300], f32s(64 * 300))
        .unwrap();
    for name in ["blk.0.attn_q.weight", "blk.0.attn_k.weight"] {
        w.add_tensor(name, t, &[64, 64], f32s(64 * 64)).unwrap();
    }
    w.add_tensor("blk.0.ffn_gate.weight", t, &[64, 128], f32s(64 * 128))
        .unwrap();
    let last = format!("blk.{}.attn_norm.weight", blocks - 1);
    w.add_tensor(last, t, &[64], f32s(64)).unwrap();
    w.to_bytes()
}

#[test]
fn a_gguf_block_count_beyond_the_bound_is_refused_naming_the_key() {
    let s = Scratch::new("gguf");
    let path = s.0.join("many.gguf");
    std::fs::write(&path, gguf_with_blocks(1025)).unwrap();
    let e = ModelShape::from_gguf(&path).unwrap_err().to_string();
    assert!(
        e.contains("many.gguf") && e.contains("'llama.block_count'"),
        "{e}"
    );
    assert!(e.contains("1..=1024"), "{e}");
    let p = path.to_str().unwrap();
    refused(
        &["plan", "--model", p, "--cluster", "h100x8-nvswitch"],
        &["llama.block_count"],
    );
}

#[test]
fn huge_counts_in_a_bert_config_are_refused_naming_the_key() {
    let s = Scratch::new("bert");
    let base = json!({
        "hidden_size": 384, "num_attention_heads": 12, "intermediate_size": 1536,
        "num_hidden_layers": 6, "vocab_size": 30522, "max_position_embeddings": 512,
        "type_vocab_size": 2, "layer_norm_eps": 1e-12
    });
    for (key, v) in [
        ("num_hidden_layers", json!(16777216)),
        ("max_position_embeddings", json!(1u64 << 40)),
        ("type_vocab_size", json!(1u64 << 30)),
        ("num_attention_heads", json!(5)),
        ("layer_norm_eps", json!(1e300)),
    ] {
        let mut c = base.clone();
        c[key] = v;
        std::fs::write(s.0.join("config.json"), c.to_string()).unwrap();
        let e = metashard::models::bert::BertConfig::from_model_dir(&s.0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("config.json") && e.contains(key), "{key}: {e}");
    }
}

#[test]
fn workloads_that_overflow_or_cannot_be_costed_are_refused_naming_the_key() {
    let e = refused(
        &[
            "plan",
            "--workload",
            "pp=18446744073709551615,tg=2,ctx=1",
            "--cluster",
            "h100x8-nvswitch",
        ],
        &["workload ctx", "18446744073709551617"],
    );
    assert!(!e.contains("chunks"), "{e}");
    for (bad, key) in [
        (
            "pp=18446744073709551615,tg=18446744073709551615,ctx=18446744073709551615",
            "ctx",
        ),
        ("pp=1,ctx=4294967296", "ctx"),
        ("pp=4096,tg=1024,batch=64,ctx=20000000", "mask"),
        // A KV cache of ctx positions for each of the batch's sequences.
        ("pp=4096,tg=1024,batch=4096,ctx=2000000000", "batch"),
    ] {
        let e = Workload::parse(bad).unwrap_err().to_string();
        assert!(e.contains("workload") && e.contains(key), "{bad}: {e}");
    }
}

#[test]
fn shares_whose_sum_overflows_spread_layers_as_their_ratios_say() {
    let shares = "1e308,1e308,0,0,0,0,0,0";
    let (code, err, _, out) = metashard(&[
        "plan",
        "--model",
        "smollm2-135m",
        "--cluster",
        "h100x8-nvswitch",
        "--strategy",
        "layer",
        "--shares",
        shares,
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    let layers: Vec<u64> = v["memory"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["layers"][1].as_u64().unwrap() - m["layers"][0].as_u64().unwrap())
        .collect();
    // Two equal shares: 15 layers each, none on the devices of share 0.
    assert_eq!(layers, [15, 15, 0, 0, 0, 0, 0, 0]);
    // Infinite or negative shares stay errors naming the flag.
    refused(
        &[
            "plan",
            "--cluster",
            "h100x8-nvswitch",
            "--shares",
            "inf,1,1,1,1,1,1,1",
        ],
        &["--shares"],
    );
}

/// The `h100x8-nvswitch` preset as a profile file, with `edit` applied.
fn profile(s: &Scratch, name: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let c = Cluster::preset("h100x8-nvswitch").unwrap();
    let mut v: Value = serde_json::from_str(&c.to_json()).unwrap();
    edit(&mut v);
    s.file(name, &v.to_string())
}

#[test]
fn profile_figures_outside_their_physical_range_are_refused_naming_the_field() {
    let s = Scratch::new("profile");
    let good = profile(&s, "good.json", |_| {});
    let (code, err, _, _) = metashard(&["plan", "--cluster", good.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    // (object at a JSON pointer, key set in it, value, the field the error names)
    let bad = [
        (
            "/devices/0",
            "node_overhead_s",
            json!(-0.99),
            "node_overhead_s",
        ),
        (
            "/devices/3",
            "step_overhead_s",
            json!(-1e-9),
            "step_overhead_s",
        ),
        (
            "/devices/0",
            "step_overhead_s",
            json!(1e6),
            "step_overhead_s",
        ),
        ("/devices/0", "mem_bw", json!(0.0), "mem_bw"),
        ("/devices/1", "mem_bw", json!(1e300), "mem_bw"),
        ("/devices/0/gemv_bw", "q8_0", json!(-5.0), "gemv_bw.q8_0"),
        ("/devices/0/gemv_bw", "q8-0", json!(5e9), "gemv_bw"),
        (
            "/devices/0/gemm_flops",
            "bf16",
            json!(1e30),
            "gemm_flops.bf16",
        ),
        ("/devices/0", "memory_bytes", json!(0), "memory_bytes"),
        ("/links/intra/all_gather", "bus_bw", json!(1e-300), "bus_bw"),
        (
            "/links/intra/all_reduce",
            "alpha_s",
            json!([[2, -1.0]]),
            "alpha_s",
        ),
        (
            "/links/intra/all_reduce",
            "alpha_s",
            json!([[8, 1e-5], [2, 1e-5]]),
            "alpha_s",
        ),
        (
            "/links/intra/all_reduce",
            "alpha_s",
            json!([[2, 1e9]]),
            "alpha_s",
        ),
        ("/links", "devices_per_node", json!(0), "devices_per_node"),
        (
            "/links/intra",
            "broadcast",
            json!({"alpha_s": [], "bus_bw": -1.0}),
            "broadcast.bus_bw",
        ),
        ("", "devices", json!([]), "devices"),
    ];
    for (i, (at, key, value, field)) in bad.into_iter().enumerate() {
        let path = profile(&s, &format!("bad{i}.json"), |v| {
            v.pointer_mut(at).unwrap()[key] = value
        });
        let p = path.to_str().unwrap();
        refused(&["plan", "--cluster", p], &[p, field]);
        assert!(Cluster::load(&path).is_err(), "{at} {key}");
    }
    // The profile: node overhead -0.99 s predicted 18,920 tokens/s instead of 96.8.
    let path = profile(&s, "neg.json", |v| {
        v["devices"][0]["node_overhead_s"] = json!(-0.99)
    });
    let e = Cluster::load(&path).unwrap_err().to_string();
    assert!(
        e.contains("devices[0]") && e.contains("-0.99") && e.contains("0..=10"),
        "{e}"
    );
}

/// A FIFO at `path` (no writer ever opens it).
fn fifo(path: &Path) {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path; mkfifo only creates the file.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(rc, 0, "mkfifo {}", path.display());
}

/// A Gemma 2 file whose sliding window is 2^32-1 positions, beyond the 32-bit positions (it
/// wrapped to -1 in the causal mask, masking every position): refused naming the key.
#[test]
fn a_gguf_sliding_window_beyond_the_positions_is_refused_naming_the_key() {
    use metashard::models::arch::GEMMA2;
    use metashard::models::hparams::{DecoderConfig, SlidingWindow};
    let cfg = DecoderConfig {
        arch: &GEMMA2,
        swa: Some(SlidingWindow {
            window: 5,
            pattern: 2,
            rope_base: 10000.0,
        }),
        ..DecoderConfig::llama(2, 64, 128, 4, 2, 300)
    };
    let mut bytes =
        metashard::models::synthetic::gguf_bytes(&cfg, metashard::DType::F32, true, 64, 1).unwrap();
    // The key, its type (GGUF_TYPE_UINT32 = 4) and its value, little-endian (GGUF spec).
    let mut key = b"gemma2.attention.sliding_window".to_vec();
    key.extend_from_slice(&4u32.to_le_bytes());
    let at = bytes
        .windows(key.len())
        .position(|w| w == key.as_slice())
        .unwrap()
        + key.len();
    assert_eq!(bytes[at..at + 4], 5u32.to_le_bytes());
    bytes[at..at + 4].copy_from_slice(&u32::MAX.to_le_bytes());
    let s = Scratch::new("window");
    let path = s.0.join("window.gguf");
    std::fs::write(&path, bytes).unwrap();
    let e = ModelShape::from_gguf(&path).unwrap_err().to_string();
    assert!(
        e.contains("window.gguf")
            && e.contains("'gemma2.attention.sliding_window'")
            && e.contains("4294967295"),
        "{e}"
    );
}

#[test]
fn special_and_huge_files_are_refused_naming_them() {
    let s = Scratch::new("special");
    let pipe = s.0.join("pipe.json");
    fifo(&pipe);
    let huge = s.0.join("huge.json");
    // Sparse: 4 GiB that take no disk.
    std::fs::File::create(&huge)
        .unwrap()
        .set_len(4 << 30)
        .unwrap();
    let cfg_dir = s.0.join("model");
    std::fs::create_dir_all(&cfg_dir).unwrap();
    for (path, what) in [
        (pipe.as_path(), "FIFO"),
        (Path::new("/dev/zero"), "character device"),
        (huge.as_path(), "limit"),
    ] {
        let p = path.to_str().unwrap();
        refused(&["plan", "--cluster", p], &[p, what]);
        refused(
            &["plan", "--model", p, "--cluster", "h100x8-nvswitch"],
            &[p, what],
        );
        refused(&["run", "--plan", p, "--devices", "cpu:2x1"], &[p, what]);
        refused(
            &[
                "calibrate",
                "--devices",
                "cpu:1",
                "--quick",
                "--hosts",
                "2",
                "--inter",
                p,
            ],
            &[p, what],
        );
        for e in [
            Cluster::load(path).map(|_| ()),
            metashard::planner::load_plan(path, 30, 2).map(|_| ()),
            metashard::io::JsonConfig::open(path).map(|_| ()),
            metashard::tokenizer::WordPieceTokenizer::from_file(path).map(|_| ()),
        ] {
            let e = e.unwrap_err();
            assert!(matches!(e, Error::Io { .. }), "{e}");
            assert!(e.to_string().contains(what), "{e}");
        }
    }
}

#[test]
fn huge_flag_values_are_refused_before_anything_is_measured() {
    let max = "18446744073709551615";
    refused(
        &[
            "calibrate",
            "--devices",
            "cpu:1",
            "--quick",
            "--hosts",
            "1000000",
            "--inter",
            "x.json",
        ],
        &["--hosts", "1024"],
    );
    refused(
        &[
            "calibrate",
            "--devices",
            "cpu:2x1",
            "--quick",
            "--hosts",
            max,
            "--inter",
            "x.json",
        ],
        &["--hosts"],
    );
    refused(
        &["bench", "strategies", "--pp", max, "--devices", "cpu:2x1"],
        &["--pp + --tg", "context"],
    );
    refused(
        &["bench", "strategies", "--tg", max, "--devices", "cpu:2x1"],
        &["--pp + --tg"],
    );
    // Repetition counts and buffer sizes are bounded where clap reads them (exit code 2).
    for args in [
        &["bench", "meta", "--reps", max][..],
        &["bench", "comm", "--reps", max],
        &["bench", "comm", "--bytes", max],
        &["bench", "model", "--reps", max],
        &["bench", "strategies", "--reps", max],
        &["bench", "strategies", "--calibrations", max],
    ] {
        let (code, err, secs, _) = metashard(args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(args[2]) && !err.contains("panicked"), "{err}");
        assert!(secs < BOUND.as_secs_f64());
    }
}

/// `bench comm --json` rows: each collective at two sizes for every `ranks` in `ns`.
fn comm_rows(ns: impl Iterator<Item = usize>) -> String {
    let mut rows = Vec::new();
    for n in ns {
        for c in ["all_reduce", "all_gather", "reduce_scatter"] {
            for (bytes, us) in [(65536, 40.0), (16 << 20, 9000.0)] {
                rows.push(json!({"collective": c, "ranks": n, "bytes": bytes,
                                 "median_us": us * (1.0 + n as f64 / 1e4)}));
            }
        }
    }
    Value::Array(rows).to_string()
}

#[test]
fn collectives_timed_between_hosts_are_bounded_and_fitted_fast() {
    let s = Scratch::new("inter");
    // 3,000 distinct rank counts: more ranks than a cluster may have, named at once (the fit
    // took over 300 s before).
    let many = s.file("many.json", &comm_rows(2..3002));
    let p = many.to_str().unwrap();
    let args = [
        "calibrate",
        "--devices",
        "cpu:1",
        "--quick",
        "--hosts",
        "2",
        "--inter",
        p,
    ];
    refused(&args, &[p, "`ranks`", "1024"]);
    for (row, field) in [
        (
            json!({"collective": "all_reduce", "ranks": 2.5, "bytes": 4096, "median_us": 5}),
            "ranks",
        ),
        (
            json!({"collective": "all_reduce", "ranks": 2, "bytes": 1e300, "median_us": 5}),
            "bytes",
        ),
        (
            json!({"collective": "all_reduce", "ranks": 2, "bytes": 4096, "median_us": 1e300}),
            "median_us",
        ),
        (
            json!({"collective": "all_reduce", "ranks": 2, "bytes": 4096, "median_us": -5}),
            "median_us",
        ),
    ] {
        let f = s.file("row.json", &Value::Array(vec![row]).to_string());
        let p = f.to_str().unwrap();
        let args = [
            "calibrate",
            "--devices",
            "cpu:1",
            "--quick",
            "--hosts",
            "2",
            "--inter",
            p,
        ];
        refused(&args, &[p, field]);
    }
    // 1,023 distinct counts (every group size a cluster can have) fit in well under a second.
    let rows: Vec<(
        metashard::planner::Collective,
        metashard::planner::LinkSample,
    )> = {
        let v: Vec<Value> = serde_json::from_str(&comm_rows(2..1025)).unwrap();
        v.iter()
            .map(|r| {
                let c = match r["collective"].as_str().unwrap() {
                    "all_reduce" => metashard::planner::Collective::AllReduce,
                    "all_gather" => metashard::planner::Collective::AllGather,
                    _ => metashard::planner::Collective::ReduceScatter,
                };
                let smp = metashard::planner::LinkSample {
                    n: r["ranks"].as_u64().unwrap() as usize,
                    bytes: r["bytes"].as_u64().unwrap() as usize,
                    seconds: r["median_us"].as_f64().unwrap() * 1e-6,
                    reps: 1,
                };
                (c, smp)
            })
            .collect()
    };
    let start = Instant::now();
    let (level, _) = metashard::planner::fit_level("test", &rows).unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    level.validate("test").unwrap();
}
