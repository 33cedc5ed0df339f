//! Tokenizer-only GGUF files built from a Hugging Face `tokenizer.json` and
//! `tokenizer_config.json` with metashard's GGUF writer, the way llama.cpp's
//! `convert_hf_to_gguf.py` writes a byte-level BPE vocabulary (`_set_vocab_gpt2`,
//! `get_vocab_base`): tokens by id (a missing id becomes `[PAD<id>]`, unused), added tokens
//! control when special or looking special (`<|...|>`) and user-defined otherwise, merges as
//! "a b", special ids from the config's token strings, and the config's chat template.

use metashard::io::{GgufArray, GgufValue, GgufWriter};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

/// What the converter takes from outside the two files.
pub struct HfVocab<'a> {
    /// `general.architecture` ("qwen2", "llama").
    pub arch: &'a str,
    /// `tokenizer.ggml.pre` ("qwen2", "llama-bpe").
    pub pre: &'a str,
    pub add_bos: bool,
    /// The BOS token when the config names none (Qwen's `<|endoftext|>`, as llama.cpp sets).
    pub default_bos: Option<&'a str>,
}

fn read(path: &Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e} (run scripts/fetch_models.sh)", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Writes `out` from the tokenizer files in `dir`.
pub fn write_gguf(dir: &Path, v: &HfVocab, out: &Path) {
    let tj = read(&dir.join("tokenizer.json"));
    let tc = read(&dir.join("tokenizer_config.json"));
    let mut vocab: HashMap<String, u32> = tj["model"]["vocab"]
        .as_object()
        .expect("model.vocab")
        .iter()
        .map(|(k, id)| (k.clone(), id.as_u64().unwrap() as u32))
        .collect();
    let mut added: HashMap<String, bool> = HashMap::new();
    for a in tj["added_tokens"].as_array().expect("added_tokens") {
        let content = a["content"].as_str().unwrap().to_string();
        vocab.insert(content.clone(), a["id"].as_u64().unwrap() as u32);
        added.insert(content, a["special"].as_bool().unwrap_or(false));
    }
    let n = vocab.values().max().unwrap() + 1;
    let mut by_id: Vec<Option<String>> = vec![None; n as usize];
    for (t, &id) in &vocab {
        by_id[id as usize] = Some(t.clone());
    }
    let mut tokens = Vec::with_capacity(n as usize);
    let mut types = Vec::with_capacity(n as usize);
    for (i, t) in by_id.into_iter().enumerate() {
        let Some(t) = t else {
            tokens.push(format!("[PAD{i}]"));
            types.push(5);
            continue;
        };
        let ty = match added.get(&t) {
            Some(&special) if special || (t.starts_with("<|") && t.ends_with("|>")) => 3,
            Some(_) => 4,
            None => 1,
        };
        tokens.push(t);
        types.push(ty);
    }
    let merges: Vec<String> = tj["model"]["merges"]
        .as_array()
        .expect("model.merges")
        .iter()
        .map(|m| match m {
            Value::String(s) => s.clone(),
            Value::Array(p) => format!("{} {}", p[0].as_str().unwrap(), p[1].as_str().unwrap()),
            other => panic!("merge {other}"),
        })
        .collect();
    let token_id = |key: &str| -> Option<u32> {
        let t = match &tc[key] {
            Value::String(s) => Some(s.as_str()),
            Value::Object(o) => o.get("content").and_then(Value::as_str),
            _ => None,
        }?;
        vocab.get(t).copied()
    };
    let mut w = GgufWriter::new();
    let s = |x: &str| GgufValue::String(x.to_string());
    w.add("general.architecture", s(v.arch));
    w.add("tokenizer.ggml.model", s("gpt2"));
    w.add("tokenizer.ggml.pre", s(v.pre));
    w.add(
        "tokenizer.ggml.tokens",
        GgufValue::Array(GgufArray::String(tokens)),
    );
    w.add(
        "tokenizer.ggml.token_type",
        GgufValue::Array(GgufArray::I32(types)),
    );
    w.add(
        "tokenizer.ggml.merges",
        GgufValue::Array(GgufArray::String(merges)),
    );
    let bos = token_id("bos_token").or_else(|| v.default_bos.and_then(|b| vocab.get(b).copied()));
    for (key, id) in [
        ("tokenizer.ggml.bos_token_id", bos),
        ("tokenizer.ggml.eos_token_id", token_id("eos_token")),
        ("tokenizer.ggml.padding_token_id", token_id("pad_token")),
    ] {
        if let Some(id) = id {
            w.add(key, GgufValue::U32(id));
        }
    }
    w.add("tokenizer.ggml.add_bos_token", GgufValue::Bool(v.add_bos));
    if let Some(t) = tc["chat_template"].as_str() {
        w.add("tokenizer.chat_template", s(t));
    }
    w.write(out).unwrap();
}
