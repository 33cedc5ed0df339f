//! The BERT encoder (all-MiniLM-L6-v2): embeddings against the independent numpy reference
//! (`scripts/reference/minilm_ref.py`), a padded batch against sentences run alone, meta
//! devices of N = 1, 2, 3, 5 against one device (with the expected collectives), the built-in
//! split callback (whole heads, uneven counts, rotation), bad model folders, and the `embed`
//! command end to end.

use metashard::meta::{ConversionKind, MetaDevice};
use metashard::models::arch::{Naming, Tensor};
use metashard::models::bert::{BertConfig, BertEncoder, bert_split, build_graph, cosine};
use metashard::models::paths::models_dir;
use metashard::runtime::open_encoder;
use metashard::split_state::{SplitAxis, SplitState};
use metashard::tensor::Layout;
use metashard::{DType, Device, parse_devices};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

fn minilm_dir() -> PathBuf {
    models_dir().join("minilm")
}

/// Varied sentences: lengths from [CLS] [SEP] only to ~60 tokens, accents, CJK, digits,
/// punctuation; embedded as one padded batch.
fn sentences() -> Vec<&'static str> {
    vec![
        "A man is eating food.",
        "Hi",
        "",
        "The quick brown fox jumps over the lazy dog, while the cat — unimpressed — naps \
         on a warm windowsill in Zürich; meanwhile 3 engineers split a 22M-parameter \
         encoder across 5 devices and measured a 1.7x speed-up (or so they claim).",
        "Café naïve résumé: 東京 is the capital of Japan!",
        "Tensor parallelism splits every weight matrix across devices.",
    ]
}

/// Token ids and embeddings, one row per sentence.
type Reference = (Vec<Vec<u32>>, Vec<Vec<f32>>);

/// Reference output of `minilm_ref.py`: (input_ids, embeddings). `None` (with a note) only
/// when python3 or its packages are missing and METASHARD_SKIP_PYREF=1; otherwise a missing
/// interpreter or package fails the test saying what to install.
fn reference(texts: &[&str]) -> Option<Reference> {
    let install = "install python3 (3.11) and the reference packages: \
                   `python3 -m pip install -r scripts/requirements.txt` (numpy==2.4.6, \
                   tokenizers==0.23.3), or set METASHARD_SKIP_PYREF=1 to skip this comparison";
    let unavailable = |why: String| {
        if std::env::var("METASHARD_SKIP_PYREF").as_deref() == Ok("1") {
            eprintln!("NOTE: METASHARD_SKIP_PYREF=1: skipping the numpy reference ({why})");
            None
        } else {
            panic!("the numpy reference cannot run: {why}\n{install}");
        }
    };
    let dir = minilm_dir();
    let out = Command::new("python3")
        .arg("scripts/reference/minilm_ref.py")
        .arg("--model")
        .arg(&dir)
        .arg("--")
        .args(texts)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output();
    let out = match out {
        Ok(o) => o,
        Err(e) => return unavailable(format!("python3 cannot be started: {e}")),
    };
    let err = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        if err.contains("ModuleNotFoundError")
            || err.contains("No module named")
            || err.contains("needs the 'tokenizers' package")
        {
            return unavailable(err.trim().to_string());
        }
        panic!("minilm_ref.py failed ({}): {err}", out.status);
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("reference JSON");
    let ids = serde_json::from_value(v["input_ids"].clone()).expect("input_ids");
    let emb = serde_json::from_value(v["embeddings"].clone()).expect("embeddings");
    Some((ids, emb))
}

fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| {
            assert_eq!(x.len(), y.len());
            x.iter().zip(y).map(|(p, q)| (p - q).abs())
        })
        .fold(0.0, f32::max)
}

fn one_device() -> Vec<Arc<dyn Device>> {
    parse_devices("cpu:1x2").unwrap()
}

#[test]
fn embeddings_match_the_numpy_reference_in_one_padded_batch() {
    let texts = sentences();
    let enc = open_encoder(minilm_dir(), one_device(), None).unwrap();
    let got = enc.embed(&texts).unwrap();
    let b = &got.encoding;
    // Padding is exercised: lengths differ, the batch is padded to the longest.
    assert!(b.lengths.iter().min() < b.lengths.iter().max());
    assert_eq!(b.seq_len, *b.lengths.iter().max().unwrap());
    for v in &got.vectors {
        assert_eq!(v.len(), 384);
        let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "norm {norm}");
    }
    // A sentence alone (no padding) equals its row of the padded batch.
    let alone = enc.embed(&texts[..1]).unwrap();
    assert!(alone.encoding.seq_len < b.seq_len);
    let d = max_abs_diff(&alone.vectors, &got.vectors[..1]);
    assert!(d < 2e-6, "padding changed an embedding by {d}");

    let Some((ref_ids, ref_emb)) = reference(&texts) else {
        return;
    };
    for (i, ids) in ref_ids.iter().enumerate() {
        let t = b.seq_len;
        assert_eq!(&b.ids[i * t..i * t + ids.len()], &ids[..], "ids of {i}");
    }
    let cos: Vec<f64> = got
        .vectors
        .iter()
        .zip(&ref_emb)
        .map(|(a, r)| cosine(a, r))
        .collect();
    let worst = cos.iter().copied().fold(f64::INFINITY, f64::min);
    let diff = max_abs_diff(&got.vectors, &ref_emb);
    eprintln!(
        "cosine vs numpy reference: {cos:?}; worst 1 - cos = {:.3e}; max |diff| {diff:.3e}",
        1.0 - worst
    );
    for (i, c) in cos.iter().enumerate() {
        assert!(*c > 0.999, "sentence {i} {:?}: cosine {c}", texts[i]);
    }
    // Tighter than the issue asks (measured: 1 - cos ~ 1e-12, |diff| ~ 3e-7), with room for
    // kernels that sum in another order.
    assert!(1.0 - worst < 1e-8, "worst 1 - cos = {}", 1.0 - worst);
    assert!(diff < 1e-5, "max |diff| {diff}");
}

#[test]
fn meta_devices_match_one_device_with_two_all_reduces_per_layer() {
    let texts = [
        "Hi there",
        "A man is eating food.",
        "Heads split over devices.",
    ];
    let single = open_encoder(minilm_dir(), one_device(), None)
        .unwrap()
        .embed(&texts)
        .unwrap();
    let cfg = BertConfig::from_model_dir(minilm_dir()).unwrap();
    // 5 devices: 12 heads as 3 + 3 + 2 + 2 + 2, rotated per layer; 13: one device has no heads.
    for n in [1, 2, 3, 5, 13] {
        let m = MetaDevice::new(
            parse_devices(&format!("cpu:{n}x1")).unwrap(),
            bert_split(&cfg),
        )
        .unwrap();
        let enc = BertEncoder::load_on(minilm_dir(), m.clone()).unwrap();
        let got = enc.embed(&texts).unwrap();
        let d = max_abs_diff(&got.vectors, &single.vectors);
        eprintln!("meta N={n}: max |diff| vs one device {d:.3e}");
        assert!(d < 1e-5, "N={n}: max |diff| {d}");
        let bg = build_graph(&cfg, enc.weights(), &got.encoding).unwrap();
        let plan = m.meta_backend().unwrap().sharding(&bg.graph).unwrap();
        let kinds: Vec<_> = plan.conversions.iter().map(|c| c.kind).collect();
        assert_eq!(
            plan.count(ConversionKind::AllReduce),
            2 * cfg.n_layer,
            "N={n}: {kinds:?}"
        );
        for k in [
            ConversionKind::AllGather,
            ConversionKind::AllToAll,
            ConversionKind::ReduceScatter,
        ] {
            assert_eq!(plan.count(k), 0, "N={n}: {kinds:?}");
        }
    }
}

fn split_of(cfg: &BertConfig, name: &str, ne: [usize; 4], n: usize) -> SplitState {
    let f = bert_split(cfg);
    let l = Layout::contiguous(DType::F32, ne);
    f(&metashard::meta::TensorInfo {
        name,
        layout: &l,
        n_devices: n,
    })
    .unwrap()
}

#[test]
fn split_callback_keeps_whole_heads_and_rotates_the_remainder() {
    let cfg = BertConfig::from_model_dir(minilm_dir()).unwrap();
    let (e, f, hd) = (cfg.n_embd, cfg.n_ff, cfg.head_dim());
    assert_eq!((e, f, cfg.n_head, hd), (384, 1536, 12, 32));
    let ext = |s: &SplitState| s.extents().to_vec();
    for n in 1..=16 {
        let mut extra_heads = vec![0usize; n];
        for l in 0..cfg.n_layer {
            let p = |k: &str| format!("encoder.layer.{l}.{k}");
            let q = split_of(&cfg, &p("attention.self.query.weight"), [e, e, 1, 1], n);
            assert_eq!(q.axis, SplitAxis::Axis(1));
            let heads = ext(&q);
            assert_eq!(heads.iter().sum::<usize>(), e, "N={n}");
            assert!(heads.iter().all(|x| x % hd == 0), "N={n}: {heads:?}");
            let (lo, hi) = (heads.iter().min().unwrap(), heads.iter().max().unwrap());
            assert!(
                hi - lo <= hd,
                "N={n}: uneven by more than one head {heads:?}"
            );
            if hi > lo {
                for (d, x) in heads.iter().enumerate() {
                    extra_heads[d] += usize::from(x == hi);
                }
            }
            for k in ["key", "value"] {
                let w = split_of(
                    &cfg,
                    &p(&format!("attention.self.{k}.weight")),
                    [e, e, 1, 1],
                    n,
                );
                assert_eq!(w, q, "N={n} {k}");
            }
            for k in ["query", "key", "value"] {
                let b = split_of(
                    &cfg,
                    &p(&format!("attention.self.{k}.bias")),
                    [e, 1, 1, 1],
                    n,
                );
                assert_eq!(b, SplitState::axis(0, &heads), "N={n} {k} bias");
            }
            let o = split_of(&cfg, &p("attention.output.dense.weight"), [e, e, 1, 1], n);
            assert_eq!(o, SplitState::axis(0, &heads), "N={n} attention output");
            let i = split_of(&cfg, &p("intermediate.dense.weight"), [e, f, 1, 1], n);
            assert_eq!(i.axis, SplitAxis::Axis(1));
            assert_eq!(ext(&i).iter().sum::<usize>(), f);
            let ib = split_of(&cfg, &p("intermediate.dense.bias"), [f, 1, 1, 1], n);
            assert_eq!(ib, SplitState::axis(0, &ext(&i)));
            let d = split_of(&cfg, &p("output.dense.weight"), [f, e, 1, 1], n);
            assert_eq!(d, SplitState::axis(0, &ext(&i)));
            for (name, ne) in [
                (p("attention.output.dense.bias"), [e, 1, 1, 1]),
                (p("output.dense.bias"), [e, 1, 1, 1]),
                (p("attention.output.LayerNorm.weight"), [e, 1, 1, 1]),
                (p("output.LayerNorm.bias"), [e, 1, 1, 1]),
            ] {
                assert!(split_of(&cfg, &name, ne, n).is_mirrored(), "{name}");
            }
        }
        // The extra heads of an uneven split do not always land on the same device.
        if !cfg.n_head.is_multiple_of(n) && n <= cfg.n_layer {
            assert!(
                extra_heads.iter().filter(|&&c| c > 0).count() > cfg.n_head % n,
                "N={n}: extra heads always on the same devices {extra_heads:?}"
            );
        }
    }
    // 12 heads on 5 devices, explicitly: 3, 3, 2, 2, 2 on layer 0, rotated by one on layer 1.
    let q0 = split_of(
        &cfg,
        "encoder.layer.0.attention.self.query.weight",
        [e, e, 1, 1],
        5,
    );
    assert_eq!(q0, SplitState::axis(1, &[96, 96, 64, 64, 64]));
    let q1 = split_of(
        &cfg,
        "encoder.layer.1.attention.self.key.weight",
        [e, e, 1, 1],
        5,
    );
    assert_eq!(q1, SplitState::axis(1, &[64, 96, 96, 64, 64]));
    // 16 devices: four get no heads.
    let q = split_of(
        &cfg,
        "encoder.layer.0.attention.self.value.weight",
        [e, e, 1, 1],
        16,
    );
    assert_eq!(q.extents().iter().filter(|&&x| x == 0).count(), 4);
    for name in [
        "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight",
        "embeddings.LayerNorm.weight",
    ] {
        assert!(
            split_of(&cfg, name, [e, 512, 1, 1], 3).is_mirrored(),
            "{name}"
        );
    }
    assert_eq!(
        Naming::HfBert.parse("bert.encoder.layer.3.intermediate.dense.bias"),
        Some((Tensor::FfnUpBias, Some(3)))
    );
    // A tensor whose shape disagrees with the config is refused, naming it.
    let f = bert_split(&cfg);
    let l = Layout::contiguous(DType::F32, [e, 100, 1, 1]);
    let err = f(&metashard::meta::TensorInfo {
        name: "encoder.layer.0.attention.self.query.weight",
        layout: &l,
        n_devices: 2,
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("attention.self.query.weight"), "{err}");
}

/// A scratch copy of the model folder (the big file as a symlink unless replaced).
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        let d = std::env::temp_dir().join(format!("metashard-bert-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let src = minilm_dir();
        for f in [
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "sentence_bert_config.json",
        ] {
            std::fs::copy(src.join(f), d.join(f)).unwrap();
        }
        std::os::unix::fs::symlink(
            std::fs::canonicalize(src.join("model.safetensors")).unwrap(),
            d.join("model.safetensors"),
        )
        .unwrap();
        Scratch(d)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn load_err(dir: &Path) -> String {
    match open_encoder(dir, one_device(), None) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_model_folders_give_errors_naming_the_file() {
    // No config.json.
    let s = Scratch::new("noconfig");
    std::fs::remove_file(s.path().join("config.json")).unwrap();
    let e = load_err(s.path());
    assert!(e.contains("config.json"), "{e}");

    // config.json asking for a layer the file does not have.
    let s = Scratch::new("layers");
    let cfg = std::fs::read_to_string(s.path().join("config.json")).unwrap();
    let cfg = cfg.replace("\"num_hidden_layers\": 6", "\"num_hidden_layers\": 7");
    std::fs::write(s.path().join("config.json"), cfg).unwrap();
    let e = load_err(s.path());
    assert!(
        e.contains("model.safetensors")
            && e.contains("num_hidden_layers is 7")
            && e.contains("6 layers"),
        "{e}"
    );

    // A layer count far beyond the file's is checked against the tensors before anything is
    // sized by it (it aborted allocating gigabytes for the list of weights).
    let s = Scratch::new("huge-layers");
    let cfg = std::fs::read_to_string(s.path().join("config.json")).unwrap();
    let cfg = cfg.replace(
        "\"num_hidden_layers\": 6",
        "\"num_hidden_layers\": 16777216",
    );
    std::fs::write(s.path().join("config.json"), cfg).unwrap();
    let t = std::time::Instant::now();
    let e = load_err(s.path());
    assert!(e.contains("num_hidden_layers is 16777216"), "{e}");
    assert!(t.elapsed().as_secs() < 20, "took {:?}", t.elapsed());

    // Corrupted safetensors: a truncated copy, then a header length beyond the file.
    let s = Scratch::new("truncated");
    let st = s.path().join("model.safetensors");
    let head = {
        use std::io::Read;
        let mut f = std::fs::File::open(minilm_dir().join("model.safetensors")).unwrap();
        let mut buf = vec![0u8; 1 << 16];
        f.read_exact(&mut buf).unwrap();
        buf
    };
    std::fs::remove_file(&st).unwrap();
    std::fs::write(&st, &head).unwrap();
    let e = load_err(s.path());
    assert!(e.contains("model.safetensors"), "{e}");
    let mut bad = head.clone();
    bad[..8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    std::fs::write(&st, &bad).unwrap();
    let e = load_err(s.path());
    assert!(
        e.contains("model.safetensors") && e.contains("header"),
        "{e}"
    );
}

#[test]
fn embed_command_prints_json_and_a_summary() {
    let bin = env!("CARGO_BIN_EXE_metashard");
    let texts = [
        "A man is eating food.",
        "A man eats a meal.",
        "The sky is blue.",
    ];
    let out = Command::new(bin)
        .args(["embed", "--model", "minilm", "--devices", "cpu:2", "--json"])
        .args(["--batch-size", "2"]) // two batches: 2 sentences, then 1
        .args(texts)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "embed failed: {err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    let rows = v.as_array().expect("an array");
    assert_eq!(rows.len(), texts.len());
    let mut vecs = Vec::new();
    for (r, t) in rows.iter().zip(texts) {
        assert_eq!(r["text"], t);
        assert!(r["tokens"].as_u64().unwrap() >= 3);
        let e: Vec<f32> = serde_json::from_value(r["embedding"].clone()).unwrap();
        assert_eq!(e.len(), 384);
        vecs.push(e);
    }
    // Same numbers as the library on one device in one batch; paraphrases are closer than
    // unrelated text.
    let want = open_encoder(minilm_dir(), one_device(), None)
        .unwrap()
        .embed(&texts)
        .unwrap();
    let d = max_abs_diff(&vecs, &want.vectors);
    assert!(d < 1e-5, "CLI on cpu:2 vs library on one device: {d}");
    assert!(cosine(&vecs[0], &vecs[1]) > cosine(&vecs[0], &vecs[2]) + 0.2);

    let out = Command::new(bin)
        .args(["embed", "--devices", "cpu:1x1"])
        .args(&texts[..2])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("cosine similarity") && text.contains("norm 1.0000"),
        "{text}"
    );

    // A bad model path is an error naming it, not a panic.
    let out = Command::new(bin)
        .args(["embed", "--model", "/nonexistent/bert", "hello"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("/nonexistent/bert") && !err.contains("panicked"),
        "{err}"
    );
}

/// The token count of `text` with [CLS] and [SEP] by Hugging Face `tokenizers` on the model's
/// tokenizer.json, without truncation (`scripts/reference/tokenize_ref.py`); `None` where the
/// package is missing and METASHARD_SKIP_PYREF=1.
fn hf_token_count(text: &str) -> Option<usize> {
    let out = Command::new("python3")
        .arg("scripts/reference/tokenize_ref.py")
        .arg("wordpiece")
        .arg(minilm_dir().join("tokenizer.json"))
        .arg(text)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("python3 starts");
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        if std::env::var("METASHARD_SKIP_PYREF").as_deref() == Ok("1") {
            eprintln!("NOTE: METASHARD_SKIP_PYREF=1: skipping the tokenizers count ({err})");
            return None;
        }
        panic!("tokenize_ref.py failed: {err}");
    }
    let ids: Vec<u32> = serde_json::from_str(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .expect("a line"),
    )
    .expect("a JSON list of ids");
    Some(ids.len())
}

#[test]
fn embed_says_which_sentences_it_cuts_to_the_model_s_256_tokens() {
    // 300 words and some punctuation: well over 256 tokens.
    let long = format!("{}.", ["the quick brown fox, jumps"; 60].join(" "));
    let short = "A man is eating food.";
    let out = Command::new(env!("CARGO_BIN_EXE_metashard"))
        .args(["embed", "--json", "--devices", "cpu:1x1", &long, short])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON on stdout");
    assert_eq!(v[0]["tokens"], 256, "{v}");
    assert_eq!(v[0]["truncated"], true);
    assert_eq!(v[1]["truncated"], false);
    // One line on stderr for the sentence cut, with its full length as Hugging Face's
    // tokenizer counts it; none for the other.
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("more than the model's"))
        .collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].starts_with("embed: sentence [0] "), "{}", lines[0]);
    if let Some(full) = hf_token_count(&long) {
        assert!(full > 256);
        assert!(
            lines[0].contains(&format!("has {full} tokens, more than the model's 256")),
            "{} (tokenizers: {full})",
            lines[0]
        );
    }
    // The summary says so too.
    let out = Command::new(env!("CARGO_BIN_EXE_metashard"))
        .args(["embed", "--devices", "cpu:1x1", &long])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("256 tokens (truncated)"));
    // What is embedded is the first 256 tokens, as sentence-transformers cuts (the numpy
    // reference truncates at its max_seq_length, 256).
    let got: Vec<f32> = serde_json::from_value(v[0]["embedding"].clone()).unwrap();
    let Some((ids, emb)) = reference(&[&long]) else {
        return;
    };
    assert_eq!(ids[0].len(), 256);
    let d = max_abs_diff(&[got], &emb);
    assert!(d < 1e-5, "the cut sentence vs the reference: {d}");
}
