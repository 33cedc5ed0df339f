//! The CUDA backend's parts that need no GPU: every kernel compiles with NVRTC for sm_80
//! (A100) and sm_90 (H100) (NVRTC needs no GPU); the kernels' argument structs match
//! `kernels.cu`; library discovery; the one-GPU communicator's rendezvous (barriers, deadline
//! naming the late ranks, mismatched collectives, abort). CI installs NVRTC from PyPI (`nvidia-cuda-nvrtc-cu12`) and points
//! `METASHARD_CUDA_LIBS` at it; elsewhere the test looks for that wheel through `python3`, and
//! without NVRTC it skips with one line, unless `METASHARD_REQUIRE_NVRTC=1` (set by
//! `scripts/test.sh`) makes that a failure.
#![cfg(feature = "cuda")]

use metashard::DType;
use metashard::cuda::comm::{Deposit, Rendezvous};
use metashard::cuda::kernels::{Fault, KERNELS, SOURCE, Tensor, compile, dtype_code, kernels_for};
use metashard::cuda::libs::{Lib, candidates_in, present};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The `lib/` folder of the NVRTC wheel, asked of python3.
fn wheel_dir() -> Option<String> {
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import nvidia.cuda_nvrtc as m, os; print(os.path.join(list(m.__path__)[0], 'lib'))",
        ])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90() {
    if std::env::var_os("METASHARD_CUDA_LIBS").is_none()
        && let Some(d) = wheel_dir()
    {
        // SAFETY: no other test of this binary reads or writes the environment.
        unsafe { std::env::set_var("METASHARD_CUDA_LIBS", d) };
    }
    if !present(Lib::Nvrtc) {
        let required = std::env::var("METASHARD_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
        assert!(
            !required,
            "METASHARD_REQUIRE_NVRTC=1 but NVRTC was not found"
        );
        println!("skipped: NVRTC not found (pip install nvidia-cuda-nvrtc-cu12)");
        return;
    }
    for arch in ["compute_80", "compute_90"] {
        let ptx = compile(arch).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            ptx.contains(&format!(".target sm_{}", &arch[8..])),
            "{arch}"
        );
        for k in KERNELS {
            assert!(
                ptx.contains(&format!(".entry {k}(")),
                "{k} missing from the PTX for {arch}"
            );
        }
    }
}

#[test]
fn every_listed_kernel_is_defined_once_and_every_defined_one_listed() {
    let mut defined: Vec<&str> = SOURCE
        .split("extern \"C\" __global__ void ")
        .skip(1)
        .map(|s| s.split('(').next().unwrap())
        .collect();
    defined.sort();
    let mut listed = KERNELS.to_vec();
    listed.sort();
    assert_eq!(defined, listed);
}

#[test]
fn argument_structs_have_the_kernels_layout() {
    // struct Tensor: a pointer, ne[4], nb[4], two ints; struct Fault: two ints, five i64.
    assert_eq!(std::mem::size_of::<Tensor>(), 80);
    assert_eq!(std::mem::size_of::<Fault>(), 48);
    // The types with kernels have codes 0..=6; the others (Q5_0 .. IQ4_XS) none yet.
    let codes: Vec<i32> = DType::ALL.iter().filter_map(|&d| kernels_for(d)).collect();
    assert_eq!(codes, [0, 1, 2, 3, 4, 5, 6]);
    for d in DType::ALL {
        if let Some(c) = kernels_for(d) {
            assert_eq!(dtype_code(d), c, "{d}");
        }
    }
    assert_eq!(kernels_for(DType::Q4_K), None);
    for (name, code) in [("T_F32", 0), ("T_I32", 3), ("T_Q8_0", 4), ("T_Q4_1", 6)] {
        assert!(SOURCE.contains(&format!("#define {name} {code}")), "{name}");
    }
}

#[test]
fn library_candidates_are_versions_of_the_library_only() {
    let dir = std::env::temp_dir().join(format!("metashard-libs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for n in [
        "libnvrtc.so.12",
        "libnvrtc-builtins.so.12.9",
        "libnvrtc.alt.so.12",
        "libnvrtc.so",
        "libcublas.so.13",
    ] {
        std::fs::write(dir.join(n), b"").unwrap();
    }
    let names = |stem| -> Vec<String> {
        candidates_in(&dir, stem)
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect()
    };
    assert_eq!(names("nvrtc"), ["libnvrtc.so", "libnvrtc.so.12"]);
    assert_eq!(names("cublas"), ["libcublas.so.13"]);
    assert!(names("nccl").is_empty());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `world` ranks on threads, each running `f(rank, &rendezvous)`; their results in rank order.
fn ranks<T: Send + 'static>(
    world: usize,
    timeout: Duration,
    f: impl Fn(usize, &Rendezvous) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let rv = Arc::new(Rendezvous::new("cuda0", world, timeout));
    let f = Arc::new(f);
    let hs: Vec<_> = (0..world)
        .map(|r| {
            let (rv, f) = (rv.clone(), f.clone());
            std::thread::spawn(move || f(r, &rv))
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn rendezvous_hands_every_rank_every_deposit_many_times() {
    let out = ranks(3, Duration::from_secs(10), |r, rv| {
        let mut seen = Vec::new();
        for round in 0..200u64 {
            let d = Deposit {
                a: 1000 * round + r as u64,
                sig: (1, round),
            };
            let all = rv.meet(r, d, "all-reduce").unwrap();
            seen.push(all.iter().map(|d| d.a).collect::<Vec<_>>());
            rv.barrier(r, None).unwrap();
        }
        seen
    });
    for (r, seen) in out.iter().enumerate() {
        for (round, all) in seen.iter().enumerate() {
            let want: Vec<u64> = (0..3).map(|q| 1000 * round as u64 + q).collect();
            assert_eq!(all, &want, "rank {r} round {round}");
        }
    }
}

#[test]
fn rendezvous_names_the_late_rank_within_the_deadline() {
    let t = Duration::from_millis(200);
    let start = Instant::now();
    let out = ranks(3, t, |r, rv| {
        if r == 2 {
            return Ok(Vec::new());
        }
        rv.meet(r, Deposit::default(), "all-reduce")
    });
    let waited = start.elapsed();
    for (r, res) in out.iter().take(2).enumerate() {
        let e = res.as_ref().unwrap_err().to_string();
        assert!(e.contains("[2]"), "rank {r}: {e}");
    }
    assert!(waited < Duration::from_secs(5), "{waited:?}");
}

#[test]
fn rendezvous_refuses_mismatched_collectives_and_stays_failed() {
    let out = ranks(2, Duration::from_secs(10), |r, rv| {
        let d = Deposit {
            a: 0,
            sig: (1 + r as u8, 0),
        };
        let first = rv.meet(r, d, "a collective").map(|_| ());
        let again = rv.meet(r, Deposit::default(), "all-reduce").map(|_| ());
        (first, again, rv.failure())
    });
    for (first, again, failure) in out {
        assert!(
            first
                .unwrap_err()
                .to_string()
                .contains("different collective")
        );
        assert!(again.is_err());
        assert!(failure.is_some());
    }
}

#[test]
fn an_abort_releases_waiting_ranks_at_once() {
    let start = Instant::now();
    let out = ranks(2, Duration::from_secs(30), |r, rv| {
        if r == 1 {
            std::thread::sleep(Duration::from_millis(50));
            rv.fail_with("rank 1: its thread panicked".into());
            return Err("aborted".to_string());
        }
        rv.meet(r, Deposit::default(), "all-reduce")
            .map(|_| ())
            .map_err(|e| e.to_string())
    });
    assert!(
        out[0].as_ref().unwrap_err().contains("panicked"),
        "{:?}",
        out[0]
    );
    assert!(start.elapsed() < Duration::from_secs(5));
}
