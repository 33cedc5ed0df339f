//! Where model files are: `--model smollm2` and `--model minilm` name the models the project's
//! fetch script (`scripts/fetch_models.sh`) unpacks into the cache folder
//! (`$METASHARD_MODELS`, else `./models-cache`, else the source tree's `models-cache`);
//! anything else is a path to a `.gguf` file or a safetensors model folder.

use crate::{Error, Result};
use std::path::{Path, PathBuf};

/// The model cache folder.
pub fn models_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("METASHARD_MODELS") {
        return PathBuf::from(d);
    }
    let local = PathBuf::from("models-cache");
    if local.is_dir() {
        return local;
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models-cache")
}

/// The kind of model a path holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelPath {
    /// A GGUF file (Llama-family decoder).
    Gguf(PathBuf),
    /// A folder with `model.safetensors` and `config.json` (BERT encoder).
    Safetensors(PathBuf),
}

/// Resolve a model name or path.
pub fn resolve(model: &str) -> Result<ModelPath> {
    let missing = |p: &Path| Error::Model {
        model: model.to_string(),
        reason: format!(
            "model files not found at {}; run `scripts/fetch_models.sh` (or set METASHARD_MODELS)",
            p.display()
        ),
    };
    match model {
        "smollm2" => {
            let p = models_dir()
                .join("smollm2")
                .join("SmolLM2-135M-Instruct.Q4_1.gguf");
            if p.is_file() {
                Ok(ModelPath::Gguf(p))
            } else {
                Err(missing(&p))
            }
        }
        "minilm" => {
            let p = models_dir().join("minilm");
            if p.join("model.safetensors").is_file() {
                Ok(ModelPath::Safetensors(p))
            } else {
                Err(missing(&p))
            }
        }
        other => {
            let p = PathBuf::from(other);
            if p.is_file()
                && p.extension()
                    .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
            {
                Ok(ModelPath::Gguf(p))
            } else if p.is_dir() && p.join("model.safetensors").is_file() {
                Ok(ModelPath::Safetensors(p))
            } else if p.exists() {
                Err(Error::Model {
                    model: other.to_string(),
                    reason: "not a .gguf file or a folder with model.safetensors".into(),
                })
            } else {
                Err(Error::Model {
                    model: other.to_string(),
                    reason: "no such model name (smollm2, minilm) or path".into(),
                })
            }
        }
    }
}
