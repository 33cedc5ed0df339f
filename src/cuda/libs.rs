//! Finding the CUDA libraries without panicking. cudarc loads each library on first use by a
//! list of file names and panics when none loads (`cudarc::panic_no_lib_found`), so every entry
//! point of the backend asks here first.
//!
//! Where they come from: the driver (`libcuda.so.1`) from the system; NVRTC, cuBLAS and NCCL
//! often from Python wheels (`nvidia-cuda-nvrtc-cu12`, `nvidia-cublas-cu13`, ...), whose
//! `lib/` folders are not on the loader's path. Folders named in `METASHARD_CUDA_LIBS`
//! (colon-separated) are searched first: a library found there is opened by its full path with
//! `RTLD_GLOBAL`, so that cudarc's later `dlopen("libnvrtc.so.12")` finds the already loaded
//! object by its soname (glibc matches loaded libraries by soname) and its own dependencies
//! (NVRTC's builtins library) resolve from the same folder.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The libraries the backend uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lib {
    Driver,
    Nvrtc,
    Cublas,
    Nccl,
}

impl Lib {
    /// The file name stem (`lib{stem}.so*`).
    pub fn stem(self) -> &'static str {
        match self {
            Lib::Driver => "cuda",
            Lib::Nvrtc => "nvrtc",
            Lib::Cublas => "cublas",
            Lib::Nccl => "nccl",
        }
    }
}

/// Folders from `METASHARD_CUDA_LIBS`.
pub fn search_dirs() -> Vec<PathBuf> {
    std::env::var_os("METASHARD_CUDA_LIBS")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default()
}

/// Files in `dir` that are versions of `lib{stem}.so` (`libnvrtc.so.12`, `libcublas.so.13`;
/// not `libnvrtc-builtins.so.12.9` or `libnvrtc.alt.so.12`), shortest name first.
pub fn candidates_in(dir: &Path, stem: &str) -> Vec<PathBuf> {
    let prefix = format!("lib{stem}.so");
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n == prefix || n.strip_prefix(&prefix).is_some_and(|r| r.starts_with('.'))
            })
        })
        .collect();
    found.sort_by_key(|p| p.as_os_str().len());
    found
}

/// `dlopen(path, RTLD_NOW | RTLD_GLOBAL)`, kept open for the life of the process.
fn open_global(path: &Path) -> bool {
    let Some(c) = path.to_str().and_then(|s| CString::new(s).ok()) else {
        return false;
    };
    // SAFETY: a NUL-terminated path; the handle is deliberately never closed (the library stays
    // loaded for cudarc, which opens it again by soname).
    !unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) }.is_null()
}

/// Open `lib` from the search folders if it is there (once per library and process); returns
/// the path opened.
fn preload(lib: Lib) -> Option<PathBuf> {
    static DONE: [OnceLock<Option<PathBuf>>; 4] = [
        OnceLock::new(),
        OnceLock::new(),
        OnceLock::new(),
        OnceLock::new(),
    ];
    DONE[lib as usize]
        .get_or_init(|| {
            search_dirs()
                .iter()
                .flat_map(|d| candidates_in(d, lib.stem()))
                .find(|p| open_global(p))
        })
        .clone()
}

/// Whether cudarc will find `lib` (after preloading it from `METASHARD_CUDA_LIBS`). Never
/// panics.
pub fn present(lib: Lib) -> bool {
    preload(lib);
    // SAFETY: the probes only try to open the library by cudarc's candidate names.
    unsafe {
        match lib {
            Lib::Driver => cudarc::driver::sys::is_culib_present(),
            Lib::Nvrtc => cudarc::nvrtc::sys::is_culib_present(),
            Lib::Cublas => cudarc::cublas::sys::is_culib_present(),
            Lib::Nccl => cudarc::nccl::sys::is_culib_present(),
        }
    }
}

/// An error naming a missing library and where it was looked for.
pub fn missing(lib: Lib) -> String {
    if lib == Lib::Driver {
        return "the NVIDIA driver library (libcuda.so.1) was not found: no GPU driver on this \
                machine"
            .into();
    }
    let dirs = search_dirs();
    format!(
        "lib{}.so was not found on the loader's path{} (set METASHARD_CUDA_LIBS to the folder \
         holding it, e.g. a Python wheel's nvidia/*/lib)",
        lib.stem(),
        if dirs.is_empty() {
            String::new()
        } else {
            format!(
                " nor in {}",
                dirs.iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    )
}
