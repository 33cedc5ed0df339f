//! Ranks as processes (`--features mpi`): `mpirun -np 2` and `-np 3` on localhost.
//! - the MPI communicator equals the in-process one bit for bit on every collective (dtypes,
//!   uneven and zero extents, segments, every broadcast root): `metashard selftest comm`;
//! - a rank that is killed, exits, stalls or aborts makes the others fail with an error naming
//!   it, within a bound;
//! - SmolLM2's greedy tokens with one rank per process equal the same split in one process
//!   (`cpu:Nx1`) and one device; also with the two ranks on two simulated hosts (network
//!   namespaces joined by a veth pair, `scripts/two_hosts.sh`), where the test runs as root;
//! - ranks that agree or fail, rank 0's request, a bounded start-up, a rank that finishes
//!   early, a closed stdout: `tests/mpi/ranks.rs`;
//! - `serve --dist mpi`: rank 0 serves, the other rank steps with it: `tests/mpi/serve.rs`.
//!
//! Without `mpirun` on the PATH each test prints one line and returns (`scripts/test.sh`
//! installs OpenMPI, so CI runs them). OpenMPI refuses root without its two allow variables,
//! and more ranks than cores without `--oversubscribe`: both are set here. A build without the
//! feature checks only that `--dist mpi` says how to get it.

#[cfg(not(feature = "mpi"))]
#[test]
fn dist_mpi_without_the_feature_says_how_to_build_it() {
    for args in [
        &["selftest", "comm", "--dist", "mpi"][..],
        &["serve", "--dist", "mpi", "--devices", "cpu:1x1"],
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_metashard"))
            .args(args)
            .output()
            .expect("metashard runs");
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(
            e.contains("MPI support is not compiled in") && e.contains("--features mpi"),
            "{args:?}: {e}"
        );
    }
}

#[cfg(feature = "mpi")]
#[path = "mpi/ranks.rs"]
mod ranks;

#[cfg(feature = "mpi")]
#[path = "mpi/serve.rs"]
mod serve;

#[cfg(feature = "mpi")]
#[path = "support/closed_stdout.rs"]
mod closed_stdout;

#[cfg(feature = "mpi")]
mod with_mpi {
    use std::process::{Command, Output};
    use std::time::{Duration, Instant};

    pub(crate) fn mpirun_missing() -> bool {
        let found = std::env::var_os("PATH")
            .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join("mpirun").is_file()));
        if !found {
            println!("skipped: mpirun is not on the PATH (apt-get install openmpi-bin)");
        }
        !found
    }

    /// `mpirun -np n metashard args...`, its output and how long it took.
    fn mpirun(n: usize, args: &[&str]) -> (Output, Duration) {
        let t = Instant::now();
        let out = Command::new("mpirun")
            .args(["--oversubscribe", "-np", &n.to_string()])
            // Shared memory between ranks without kernel single-copy support (containers).
            .args(["--mca", "btl_vader_single_copy_mechanism", "none"])
            .arg(env!("CARGO_BIN_EXE_metashard"))
            .args(args)
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
            .output()
            .expect("mpirun starts");
        (out, t.elapsed())
    }

    /// `mpirun` with one process per entry of `apps` (MPMD: `-np 1 metashard ARGS : ...`, or
    /// another program when an entry starts with `!`), `env` added; its output and how long
    /// it took.
    pub(crate) fn mpirun_apps(apps: &[&[&str]], env: &[(&str, &str)]) -> (Output, Duration) {
        let t = Instant::now();
        let mut c = Command::new("mpirun");
        c.args(["--oversubscribe"])
            .args(["--mca", "btl_vader_single_copy_mechanism", "none"]);
        for (i, app) in apps.iter().enumerate() {
            if i > 0 {
                c.arg(":");
            }
            c.args(["-np", "1"]);
            match app.first().and_then(|a| a.strip_prefix('!')) {
                Some(program) => c.arg(program).args(&app[1..]),
                None => c.arg(env!("CARGO_BIN_EXE_metashard")).args(*app),
            };
        }
        let out = c
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .env("OMPI_MCA_rmaps_base_oversubscribe", "1")
            .envs(env.iter().copied())
            .output()
            .expect("mpirun starts");
        (out, t.elapsed())
    }

    pub(crate) fn text(b: &[u8]) -> String {
        String::from_utf8_lossy(b).into_owned()
    }

    /// `metashard args...` in this process's environment, which must succeed; its stdout.
    pub(crate) fn metashard_ok(args: &[&str]) -> String {
        let out = Command::new(env!("CARGO_BIN_EXE_metashard"))
            .args(args)
            .output()
            .expect("metashard runs");
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        text(&out.stdout)
    }

    #[test]
    fn the_mpi_communicator_equals_the_in_process_one_bit_for_bit() {
        if mpirun_missing() {
            return;
        }
        for n in [2, 3] {
            let (out, _) = mpirun(n, &["selftest", "comm", "--dist", "mpi"]);
            let (o, e) = (text(&out.stdout), text(&out.stderr));
            assert!(out.status.success(), "np {n}: {o}\n{e}");
            for r in 0..n {
                let line = format!("rank {r} of {n}: ");
                let l = o.lines().find(|l| l.starts_with(&line));
                let l = l.unwrap_or_else(|| panic!("np {n}: no line from rank {r}:\n{o}\n{e}"));
                assert!(
                    l.contains("collectives bit-identical to the in-process communicator"),
                    "{l}"
                );
            }
        }
    }

    /// Run the check with a fault injected and return the survivors' error lines; assert the
    /// job failed within `bound` and every survivor that reported named `culprit`.
    pub(crate) fn faulty(
        n: usize,
        fault: &str,
        timeout_ms: u64,
        culprit: usize,
        bound: Duration,
    ) -> String {
        let t = timeout_ms.to_string();
        let args = [
            "selftest",
            "comm",
            "--dist",
            "mpi",
            "--timeout-ms",
            &t,
            "--fault",
            fault,
        ];
        let (out, took) = mpirun(n, &args);
        let e = text(&out.stderr);
        assert!(!out.status.success(), "{fault}: the job succeeded\n{e}");
        assert!(
            took < bound,
            "{fault}: took {took:?} (bound {bound:?})\n{e}"
        );
        // mpirun ends the job once a rank is gone, so a survivor may be stopped before it
        // reports; at least one reports, and every report names the culprit. Each report is
        // one write, so mpirun's own banners do not cut it.
        let reports: Vec<&str> = e
            .lines()
            .filter(|l| {
                l.starts_with("error (rank ") && !l.starts_with(&format!("error (rank {culprit})"))
            })
            .collect();
        assert!(!reports.is_empty(), "{fault}: no survivor reported\n{e}");
        let named = format!("rank {culprit} of {n} failed");
        for r in &reports {
            assert!(
                r.contains(&named) && failed_ranks(r).all(|q| q == culprit),
                "{fault}: `{r}` does not name rank {culprit}\n{e}"
            );
        }
        reports.join("\n")
    }

    /// The ranks `line` says failed (`rank Q of N failed`).
    fn failed_ranks(line: &str) -> impl Iterator<Item = usize> + '_ {
        line.split("rank ").skip(1).filter_map(|rest| {
            let (q, tail) = rest.split_once(' ')?;
            if tail.starts_with("of ") && tail.contains(" failed") {
                q.parse().ok()
            } else {
                None
            }
        })
    }

    #[test]
    fn a_killed_or_exiting_rank_is_named_by_the_others_at_once() {
        if mpirun_missing() {
            return;
        }
        // Seen through its pid within milliseconds, long before the 20 s timeout.
        let r = faulty(3, "kill@1:5", 20_000, 1, Duration::from_secs(15));
        assert!(r.contains("exited during"), "{r}");
        let r = faulty(3, "exit@0:3", 20_000, 0, Duration::from_secs(15));
        assert!(r.contains("exited during"), "{r}");
    }

    #[test]
    fn a_stalled_rank_is_named_after_the_timeout_and_an_aborting_one_at_once() {
        if mpirun_missing() {
            return;
        }
        let t = Instant::now();
        let r = faulty(2, "stall@1:4", 2_000, 1, Duration::from_secs(20));
        assert!(
            r.contains("did not complete") && r.contains("within 2s"),
            "{r}"
        );
        assert!(
            t.elapsed() >= Duration::from_secs(2),
            "named before the timeout: {r}"
        );
        let r = faulty(3, "error@2:6", 20_000, 2, Duration::from_secs(15));
        assert!(r.contains("aborted: an injected error"), "{r}");
    }

    pub(crate) fn tokens_of(json: &str) -> Vec<u64> {
        let line = json
            .lines()
            .find(|l| l.starts_with('{'))
            .unwrap_or_else(|| panic!("no JSON line in:\n{json}"));
        let v: serde_json::Value = serde_json::from_str(line).expect("run --json prints JSON");
        v["tokens"]
            .as_array()
            .expect("tokens")
            .iter()
            .map(|t| t.as_u64().expect("token id"))
            .collect()
    }

    const RUN: &[&str] = &[
        "run",
        "--json",
        "-n",
        "24",
        "--ignore-eos",
        "--prompt",
        "Give me three tips for staying healthy.",
    ];

    #[test]
    fn smollm2_with_one_rank_per_process_gives_the_single_process_greedy_tokens() {
        if mpirun_missing() {
            return;
        }
        let local = |devices: &str| {
            let out = Command::new(env!("CARGO_BIN_EXE_metashard"))
                .args(RUN)
                .args(["--devices", devices])
                .output()
                .expect("metashard runs");
            assert!(out.status.success(), "{}", text(&out.stderr));
            tokens_of(&text(&out.stdout))
        };
        let one = local("cpu:1x1");
        assert_eq!(one.len(), 24);
        for n in [2, 3] {
            let mut args = RUN.to_vec();
            args.extend(["--dist", "mpi", "--devices", "cpu:1x1"]);
            let (out, _) = mpirun(n, &args);
            let (o, e) = (text(&out.stdout), text(&out.stderr));
            assert!(out.status.success(), "np {n}:\n{o}\n{e}");
            // Rank 0 prints; the others print nothing on stdout.
            assert_eq!(o.lines().filter(|l| l.starts_with('{')).count(), 1, "{o}");
            assert_eq!(
                tokens_of(&o),
                local(&format!("cpu:{n}x1")),
                "np {n} vs cpu:{n}x1"
            );
            assert_eq!(tokens_of(&o), one, "np {n} vs one device");
            // Every rank holds its share and says what it read of the file.
            for r in 0..n {
                let line = e
                    .lines()
                    .find(|l| l.starts_with(&format!("rank {r}: holds ")))
                    .unwrap_or_else(|| panic!("np {n}: no report from rank {r}\n{e}"));
                let mib: f64 = line["rank 0: holds ".len()..]
                    .split(' ')
                    .next()
                    .and_then(|x| x.parse().ok())
                    .unwrap_or_else(|| panic!("{line}"));
                // SmolLM2-135M Q4_1 is 92 MiB: a rank holds well under all of it.
                assert!(mib > 10.0 && mib < 85.0, "{line}");
            }
        }
    }

    /// Two simulated hosts (`scripts/two_hosts.sh`, namespaces named after this process so
    /// concurrent runs do not meet), removed when dropped, also when the test panics.
    struct TwoHosts {
        prefix: String,
    }

    impl TwoHosts {
        fn script(&self, args: &[&str]) -> Output {
            Command::new("bash")
                .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/two_hosts.sh"))
                .args(args)
                .env("MS2H_PREFIX", &self.prefix)
                .output()
                .expect("bash runs")
        }
    }

    impl Drop for TwoHosts {
        fn drop(&mut self) {
            let out = self.script(&["teardown"]);
            if !out.status.success() {
                eprintln!("two_hosts teardown: {}", text(&out.stderr));
            }
        }
    }

    #[test]
    fn two_ranks_on_two_simulated_hosts_give_the_single_process_greedy_tokens() {
        if mpirun_missing() {
            return;
        }
        // Unique per process: `t` and the pid in base 36 (interface names stay <= 15 bytes).
        let mut pid = std::process::id();
        let mut prefix = String::new();
        while pid > 0 {
            prefix.insert(0, char::from_digit(pid % 36, 36).expect("a digit"));
            pid /= 36;
        }
        let hosts = TwoHosts {
            prefix: format!("t{prefix}"),
        };
        let setup = hosts.script(&["setup"]);
        if setup.status.code() == Some(77) {
            // Not root, no `ip`, or no permission for namespaces here: nothing to test.
            println!("skipped: {}", text(&setup.stderr).trim());
            return;
        }
        assert!(setup.status.success(), "setup: {}", text(&setup.stderr));
        const RUN8: &[&str] = &[
            "run",
            "--json",
            "-n",
            "8",
            "--ignore-eos",
            "--prompt",
            "Hi.",
        ];
        let local = Command::new(env!("CARGO_BIN_EXE_metashard"))
            .args(RUN8)
            .args(["--devices", "cpu:1x1"])
            .output()
            .expect("metashard runs");
        assert!(local.status.success(), "{}", text(&local.stderr));
        let mut args = vec!["run", env!("CARGO_BIN_EXE_metashard")];
        args.extend(RUN8);
        args.extend(["--dist", "mpi", "--devices", "cpu:1x1"]);
        let out = hosts.script(&args);
        let (o, e) = (text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "{o}\n{e}");
        let want = tokens_of(&text(&local.stdout));
        assert_eq!(want.len(), 8);
        assert_eq!(tokens_of(&o), want, "{e}");
        // The ranks talked over the veth: each decode step all-gathers the vocabulary-split
        // logits (49152 x 4 bytes, half from each rank), so 8 steps move over 8 x 96 KiB each
        // way, besides the all-reduces.
        let line = e
            .lines()
            .find(|l| l.contains("bytes a->b"))
            .unwrap_or_else(|| panic!("no byte count:\n{e}"));
        let n: Vec<u64> = line.split(' ').filter_map(|w| w.parse().ok()).collect();
        assert_eq!(n.len(), 2, "{line}");
        assert!(n.iter().all(|&b| b > 8 * 96 * 1024), "{line}");
    }

    #[test]
    fn a_plan_file_runs_across_processes_as_in_one_process() {
        if mpirun_missing() {
            return;
        }
        // A plan for 2 devices (the measured preset's first host), written to a file.
        let dir = std::env::temp_dir().join(format!("metashard-mpi-plan-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        let (cluster, plan) = (dir.join("host.json"), dir.join("plan.json"));
        let host = metashard::planner::Cluster::preset("cpu2x2-netns")
            .expect("a preset")
            .take(2);
        std::fs::write(&cluster, host.to_json()).expect("written");
        let out = Command::new(env!("CARGO_BIN_EXE_metashard"))
            .args(["plan", "--model", "smollm2-135m", "--strategy", "attn-only"])
            .args(["--cluster", cluster.to_str().unwrap()])
            .args(["-o", plan.to_str().unwrap()])
            .output()
            .expect("metashard runs");
        assert!(out.status.success(), "{}", text(&out.stderr));
        let p = plan.to_str().unwrap();
        let local = Command::new(env!("CARGO_BIN_EXE_metashard"))
            .args(RUN)
            .args(["--devices", "cpu:2x1", "--plan", p])
            .output()
            .expect("metashard runs");
        assert!(local.status.success(), "{}", text(&local.stderr));
        let mut args = RUN.to_vec();
        args.extend(["--dist", "mpi", "--devices", "cpu:1x1", "--plan", p]);
        let (out, _) = mpirun(2, &args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert_eq!(
            tokens_of(&text(&out.stdout)),
            tokens_of(&text(&local.stdout))
        );
        // The plan counts 2 devices: 3 ranks are refused, naming the file.
        let (out, _) = mpirun(3, &args);
        let e = text(&out.stderr);
        assert!(!out.status.success());
        assert!(e.contains("plan.json") && e.contains("2 devices"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn uneven_shares_and_a_named_strategy_work_across_processes() {
        if mpirun_missing() {
            return;
        }
        for flags in [["--tensor-split", "3,1"], ["--strategy", "mlp-only"]] {
            let local = Command::new(env!("CARGO_BIN_EXE_metashard"))
                .args(RUN)
                .args(["--devices", "cpu:2x1"])
                .args(flags)
                .output()
                .expect("metashard runs");
            assert!(local.status.success(), "{}", text(&local.stderr));
            let mut args = RUN.to_vec();
            args.extend(["--dist", "mpi", "--devices", "cpu:1x1"]);
            args.extend(flags);
            let (out, _) = mpirun(2, &args);
            assert!(out.status.success(), "{flags:?}: {}", text(&out.stderr));
            assert_eq!(
                tokens_of(&text(&out.stdout)),
                tokens_of(&text(&local.stdout)),
                "{flags:?}"
            );
        }
        // One share per rank.
        let mut args = RUN.to_vec();
        args.extend([
            "--dist",
            "mpi",
            "--devices",
            "cpu:1x1",
            "--tensor-split",
            "1",
        ]);
        let (out, _) = mpirun(2, &args);
        let e = text(&out.stderr);
        assert!(!out.status.success());
        assert!(
            e.contains("1 share for the 2 devices of `cpu:1x1 x 2 ranks`"),
            "{e}"
        );
    }

    #[test]
    fn verify_with_one_rank_per_process_agrees_with_one_device() {
        if mpirun_missing() {
            return;
        }
        let args = [
            "verify",
            "--dist",
            "mpi",
            "--devices",
            "cpu:1x1",
            "--steps",
            "8",
            "--json",
        ];
        let (out, _) = mpirun(2, &args);
        let (o, e) = (text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "{o}\n{e}");
        let line = o
            .lines()
            .find(|l| l.starts_with('{'))
            .unwrap_or_else(|| panic!("{o}\n{e}"));
        let v: serde_json::Value = serde_json::from_str(line).expect("verify --json prints JSON");
        assert_eq!(v["greedy_tokens_equal"], 8, "{line}");
        assert_eq!(v["dist"], "mpi", "{line}");
        assert!(
            v["logits_nmse"].as_f64().is_some_and(|x| x < 1e-4),
            "{line}"
        );
    }

    /// The pid of rank `rank` among the children of process `parent` (OpenMPI starts local
    /// ranks as children of mpirun and tells each its rank in its environment).
    pub(crate) fn rank_pid(parent: u32, rank: usize) -> Option<u32> {
        let children =
            std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children")).ok()?;
        let want = format!("OMPI_COMM_WORLD_RANK={rank}");
        children
            .split_whitespace()
            .filter_map(|p| p.parse::<u32>().ok())
            .find(|p| {
                std::fs::read(format!("/proc/{p}/environ"))
                    .is_ok_and(|e| e.split(|&b| b == 0).any(|v| v == want.as_bytes()))
            })
    }

    #[test]
    fn killing_a_rank_during_generation_fails_the_others_naming_it() {
        use std::io::{BufRead, BufReader};
        if mpirun_missing() {
            return;
        }
        let mut child = Command::new("mpirun")
            .args(["--oversubscribe", "-np", "3"])
            .arg(env!("CARGO_BIN_EXE_metashard"))
            .args([
                "run",
                "--dist",
                "mpi",
                "--devices",
                "cpu:1x1",
                "--ignore-eos",
            ])
            .args(["-n", "2000", "--prompt", "Tell me a long story."])
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("mpirun starts");
        let stderr = child.stderr.take().expect("piped");
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            let mut all = Vec::new();
            for line in BufReader::new(stderr).lines().map_while(|l| l.ok()) {
                let _ = tx.send(line.clone());
                all.push(line);
            }
            all.join("\n")
        });
        // Every rank has loaded its weights: generation is under way.
        let mut loaded = 0;
        while loaded < 3 {
            let line = rx
                .recv_timeout(Duration::from_secs(120))
                .expect("ranks load");
            loaded += usize::from(line.contains(": holds "));
        }
        std::thread::sleep(Duration::from_millis(500));
        let pid = rank_pid(child.id(), 1).expect("rank 1 is a child of mpirun");
        let t = Instant::now();
        // SAFETY: sending a signal to a process we started; no memory is involved.
        assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
        let status = child.wait().expect("mpirun ends");
        let took = t.elapsed();
        let e = reader.join().expect("reader");
        assert!(!status.success(), "{e}");
        assert!(took < Duration::from_secs(15), "took {took:?}\n{e}");
        let reports: Vec<&str> = e
            .lines()
            .filter(|l| l.starts_with("error (rank 0)") || l.starts_with("error (rank 2)"))
            .collect();
        assert!(!reports.is_empty(), "no survivor reported\n{e}");
        for r in reports {
            assert!(
                r.contains("rank 1 of 3 failed") && r.contains("exited"),
                "{r}\n{e}"
            );
        }
    }

    #[test]
    fn embed_with_one_rank_per_process_prints_the_in_process_embeddings() {
        if mpirun_missing() {
            return;
        }
        let sentences = [
            "a cat sat on the mat",
            "the dog ran fast",
            "stocks fell sharply",
        ];
        let mut args = vec!["embed", "--json", "--devices", "cpu:2x1"];
        args.extend(sentences);
        let local = metashard_ok(&args);
        let mut args = vec!["embed", "--json", "--dist", "mpi", "--devices", "cpu:1x1"];
        args.extend(sentences);
        let (out, _) = mpirun(2, &args);
        assert!(out.status.success(), "{}", text(&out.stderr));
        // Byte for byte: the same sums in the same order, printed by rank 0 only.
        assert_eq!(text(&out.stdout), local);
    }

    #[test]
    fn dist_mpi_takes_one_device_per_process() {
        let out = Command::new(env!("CARGO_BIN_EXE_metashard"))
            .args(["run", "--dist", "mpi", "--devices", "cpu:2x1", "-n", "1"])
            .output()
            .expect("metashard runs");
        let e = text(&out.stderr);
        assert!(!out.status.success());
        assert!(
            e.contains("each process is one rank") && e.contains("cpu:1xT"),
            "{e}"
        );
        // --strategy auto would calibrate on every rank: refused, pointing to --plan.
        let out = Command::new(env!("CARGO_BIN_EXE_metashard"))
            .args(["run", "--dist", "mpi", "--devices", "cpu:1x1", "-n", "1"])
            .args(["--strategy", "auto"])
            .output()
            .expect("metashard runs");
        let e = text(&out.stderr);
        assert!(!out.status.success());
        assert!(e.contains("--strategy auto") && e.contains("--plan"), "{e}");
    }
}
