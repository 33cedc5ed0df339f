//! JSON configuration files of a model folder (`config.json`, `tokenizer_config.json`,
//! `sentence_bert_config.json`, ...): read through the size-limited reader of `file.rs`,
//! loaded as `serde_json::Value` with typed getters whose errors name the file and the key.

use crate::{Error, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A parsed JSON object from a file.
#[derive(Clone, Debug)]
pub struct JsonConfig {
    path: PathBuf,
    value: Value,
}

impl JsonConfig {
    /// Reads and parses `path` (a regular file of at most [`super::MAX_JSON_BYTES`]); the top
    /// level must be an object.
    pub fn open(path: impl AsRef<Path>) -> Result<JsonConfig> {
        let path = path.as_ref();
        let text = super::read_json_text(path)?;
        JsonConfig::parse(path, &text)
    }

    /// `dir/config.json`.
    pub fn open_model_config(dir: impl AsRef<Path>) -> Result<JsonConfig> {
        JsonConfig::open(dir.as_ref().join("config.json"))
    }

    /// Parses `text`; `path` names it in messages.
    pub fn parse(path: impl Into<PathBuf>, text: &str) -> Result<JsonConfig> {
        let path = path.into();
        let value: Value = serde_json::from_str(text).map_err(|e| {
            Error::format(
                &path,
                "JSON",
                format!("line {} column {}: {e}", e.line(), e.column()),
            )
        })?;
        if !value.is_object() {
            return Err(Error::format(
                &path,
                "JSON top level",
                format!("expected an object, found {}", kind(&value)),
            ));
        }
        Ok(JsonConfig { path, value })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn value(&self) -> &Value {
        &self.value
    }

    /// The value at `key`; a dotted key ("a.b") walks nested objects.
    pub fn get(&self, key: &str) -> Option<&Value> {
        key.split('.').try_fold(&self.value, |v, k| v.get(k))
    }

    fn err(&self, key: &str, reason: impl Into<String>) -> Error {
        Error::format(&self.path, format!("key '{key}'"), reason)
    }

    fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &str,
        conv: impl FnOnce(&'a Value) -> Option<T>,
    ) -> Result<Option<T>> {
        match self.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => conv(v)
                .map(Some)
                .ok_or_else(|| self.err(key, format!("expected {expected}, found {}", short(v)))),
        }
    }

    fn required<T>(&self, key: &str, v: Result<Option<T>>) -> Result<T> {
        v?.ok_or_else(|| self.err(key, "missing"))
    }

    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.typed(key, "a non-negative integer", |v| {
            v.as_u64().and_then(|u| usize::try_from(u).ok())
        })
    }

    pub fn get_usize(&self, key: &str) -> Result<usize> {
        self.required(key, self.opt_usize(key))
    }

    pub fn opt_i64(&self, key: &str) -> Result<Option<i64>> {
        self.typed(key, "an integer", Value::as_i64)
    }

    pub fn get_i64(&self, key: &str) -> Result<i64> {
        self.required(key, self.opt_i64(key))
    }

    /// Any JSON number as f64.
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.typed(key, "a number", Value::as_f64)
    }

    pub fn get_f64(&self, key: &str) -> Result<f64> {
        self.required(key, self.opt_f64(key))
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "a bool", Value::as_bool)
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        self.required(key, self.opt_bool(key))
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.typed(key, "a string", Value::as_str)
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.required(key, self.opt_str(key))
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a bool",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 40 {
        format!("{} {}...", kind(v), s.chars().take(40).collect::<String>())
    } else {
        format!("{} {s}", kind(v))
    }
}
