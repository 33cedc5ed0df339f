//! Tensors of a GGUF file stacked into one: `GgufFile::stack_tensors` makes a tensor of
//! `n` equal 2-D tensors of the file (one type, one shape `[ne0, ne1]`) stacked along a new
//! third axis, `[ne0, ne1, n]`, listed in their place; its bytes are theirs one after another
//! (`GgufFile::tensor_bytes`), as llama.cpp's loader views each part at offset `nb[2] * i` of
//! the merged tensor. The caller says which tensors make one (the models layer knows the
//! names: llama.cpp's per-expert tensors of files older than the 3-D expert tensors).

use super::gguf::{GgufFile, GgufTensorInfo};
use crate::{Error, Result};
use std::borrow::Cow;

impl GgufFile {
    /// Replace the tensors named `parts` (in that order) by one tensor `name` of shape
    /// `[ne0, ne1, parts.len()]`, listed where the first part was. An error naming the tensor
    /// at fault when a part is missing or not 2-D, when the parts differ in type or shape, or
    /// when `name` is already a tensor of the file.
    pub fn stack_tensors(&mut self, name: &str, parts: &[String]) -> Result<()> {
        let field = |n: &str| format!("tensor '{n}'");
        if self.tensor(name).is_some() {
            return Err(self.format_err(
                field(name),
                format!(
                    "the file holds it and its {} parts ({} ..) both",
                    parts.len(),
                    parts.first().map_or("", |p| p.as_str())
                ),
            ));
        }
        let mut infos: Vec<GgufTensorInfo> = Vec::with_capacity(parts.len());
        for p in parts {
            let t = self.tensor(p).ok_or_else(|| {
                self.format_err(field(p), format!("missing: `{name}` is stacked from it"))
            })?;
            if t.ne[2] != 1 || t.ne[3] != 1 {
                return Err(self.format_err(
                    field(p),
                    format!(
                        "shape {}: only 2-D tensors are stacked into `{name}`",
                        crate::Shape(t.ne)
                    ),
                ));
            }
            if let Some(first) = infos.first()
                && (first.ggml_type != t.ggml_type || first.ne != t.ne)
            {
                return Err(self.format_err(
                    field(p),
                    format!(
                        "{} {}, but `{}` is {} {}: the tensors stacked into `{name}` must \
                         share one type and shape",
                        t.type_label(),
                        crate::Shape(t.ne),
                        first.name,
                        first.type_label(),
                        crate::Shape(first.ne)
                    ),
                ));
            }
            infos.push(t.clone());
        }
        let Some(first) = infos.first() else {
            return Err(self.format_err(field(name), "no tensors to stack".to_string()));
        };
        let n = parts.len();
        let nbytes = first
            .nbytes
            .checked_mul(n)
            .ok_or_else(|| self.format_err(field(name), format!("{n} parts overflow its size")))?;
        let stacked = GgufTensorInfo {
            name: name.to_string(),
            index: first.index,
            ggml_type: first.ggml_type,
            dtype: first.dtype,
            n_dims: 3,
            ne: [first.ne[0], first.ne[1], n, 1],
            offset: first.offset,
            nbytes,
        };
        self.replace_tensors(stacked, infos);
        Ok(())
    }

    /// The tensors `name` was stacked from (`None` for a tensor the file stores).
    pub fn stacked_parts(&self, name: &str) -> Option<&[GgufTensorInfo]> {
        self.stacks().get(name).map(Vec::as_slice)
    }

    /// The data bytes of `t`, borrowed from the file, or for a stacked tensor its parts'
    /// bytes one after another (a copy); an error when metashard does not compute with its
    /// type.
    pub fn tensor_bytes(&self, t: &GgufTensorInfo) -> Result<Cow<'_, [u8]>> {
        let Some(parts) = self.stacked_parts(&t.name) else {
            return self.tensor_data(t).map(Cow::Borrowed);
        };
        let mut out = Vec::with_capacity(t.nbytes);
        for p in parts {
            out.extend_from_slice(self.tensor_data(p)?);
        }
        Ok(Cow::Owned(out))
    }

    fn format_err(&self, field: String, reason: String) -> Error {
        Error::format(self.path(), field, reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;
    use crate::io::GgufWriter;

    #[test]
    fn parts_are_stacked_in_order_and_listed_in_place() {
        let mut w = GgufWriter::new();
        let f32s = |v: &[f32]| crate::dtype::f32_to_bytes(DType::F32, v).unwrap();
        w.add_tensor("a", DType::F32, &[2], f32s(&[9.0, 9.0]))
            .unwrap();
        for (i, n) in ["p.1", "p.0"].iter().enumerate() {
            let v = [i as f32; 6];
            w.add_tensor(*n, DType::F32, &[3, 2], f32s(&v)).unwrap();
        }
        w.add_tensor("q", DType::F16, &[3, 2], vec![0; 12]).unwrap();
        let mut g = GgufFile::from_bytes("t.gguf", w.to_bytes()).unwrap();
        let parts = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        g.stack_tensors("p", &parts(&["p.0", "p.1"])).unwrap();
        let names: Vec<_> = g.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "p", "q"]);
        let t = g.tensor("p").unwrap().clone();
        assert_eq!((t.ne, t.n_dims, t.nbytes), ([3, 2, 2, 1], 3, 48));
        let b = g.tensor_bytes(&t).unwrap();
        let v = crate::dtype::bytes_to_f32(DType::F32, &b, 12).unwrap();
        assert_eq!(v, [[1.0; 6], [0.0; 6]].concat());
        assert!(
            g.tensor_data(&t)
                .unwrap_err()
                .to_string()
                .contains("tensor_bytes")
        );
        assert_eq!(g.stacked_parts("p").unwrap().len(), 2);
        // Another type, a missing part, an existing name: errors naming the tensor.
        let e = g
            .stack_tensors("r", &parts(&["a", "q"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("'q'") && e.contains("f16"), "{e}");
        let e = g
            .stack_tensors("r", &parts(&["x"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("'x'") && e.contains("missing"), "{e}");
        let e = g
            .stack_tensors("a", &parts(&["q"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("'a'"), "{e}");
    }
}
