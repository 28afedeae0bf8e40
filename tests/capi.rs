//! The C ABI from C: `capi/tests/c/capi_test.c` and the example
//! `capi/examples/allreduce_mpi.c`, compiled with Open MPI's `mpicc`
//! against `capi/include/collectives.h` and the built
//! `libcollectives_c.so`, run under `mpirun` at 2 and 4 ranks (the unique id
//! travels by MPI_Bcast, as nccl-tests hands NCCL's around).
//! Skipped without Open MPI unless COLL_REQUIRE_MPI=1.

use std::path::{Path, PathBuf};
use std::process::Command;

use integration_tests::{launcher, mpirun, sibling};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Compiles `source` with `mpicc` into the test's scratch directory.
fn compile(mpicc: &str, source: &str, name: &str) -> String {
    let lib = sibling(env!("CARGO_BIN_EXE_coll-worker"), "libcollectives_c.so");
    let libdir = Path::new(&lib).parent().unwrap();
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let status = Command::new(mpicc)
        .args(["-O1", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(repo().join("capi/include"))
        .arg(repo().join(source))
        .arg("-L")
        .arg(libdir)
        .args(["-lcollectives_c", "-lpthread", "-lm"])
        .arg(format!("-Wl,-rpath,{}", libdir.display()))
        .arg("-o")
        .arg(&out)
        .status()
        .expect("run mpicc");
    assert!(status.success(), "{mpicc} {source} failed");
    out.to_string_lossy().into_owned()
}

#[test]
fn the_c_test_passes_under_mpirun() {
    let (Some(mpicc), Some(mpirun_)) = (launcher("mpicc.openmpi"), launcher("mpirun.openmpi"))
    else {
        return;
    };
    let test = compile(mpicc, "capi/tests/c/capi_test.c", "capi_test");
    for n in [2, 4] {
        for transport in ["shm", "tcp"] {
            let r = mpirun(
                mpirun_,
                n,
                &test,
                &[],
                &[("COLL_TRANSPORT", transport), ("COLL_TIMEOUT", "60")],
            );
            assert!(
                r.ok && r.stdout.contains("capi ok"),
                "capi_test at {n} ranks over {transport}:\n{}\n{}",
                r.stdout,
                r.stderr
            );
        }
    }
}

#[test]
fn the_c_example_runs() {
    let (Some(mpicc), Some(mpirun_)) = (launcher("mpicc.openmpi"), launcher("mpirun.openmpi"))
    else {
        return;
    };
    let example = compile(mpicc, "capi/examples/allreduce_mpi.c", "allreduce_mpi");
    let r = mpirun(mpirun_, 3, &example, &[], &[]);
    assert!(r.ok, "{}\n{}", r.stdout, r.stderr);
    assert_eq!(r.stdout.matches(", 0 wrong").count(), 3, "{}", r.stdout);
}

/// The header compiles on its own, as C99 and as C++ (nothing it needs may
/// come from the includer), and COLL_CONFIG_INITIALIZER makes a blocking config.
#[test]
fn the_header_stands_alone() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let source = dir.join("header_alone.c");
    std::fs::write(
        &source,
        "#include \"collectives.h\"\nint main(void) { collConfig_t c = COLL_CONFIG_INITIALIZER; return c.blocking - 1; }\n",
    )
    .unwrap();
    for (compiler, lang) in [("cc", "c"), ("c++", "c++")] {
        let exe = dir.join(format!("header_alone_{lang}"));
        let std = if lang == "c" {
            "-std=c99"
        } else {
            "-std=c++11"
        };
        let status = Command::new(compiler)
            .args(["-Wall", "-Werror", std, "-x", lang, "-I"])
            .arg(repo().join("capi/include"))
            .arg(&source)
            .arg("-o")
            .arg(&exe)
            .status()
            .unwrap_or_else(|e| panic!("run {compiler}: {e}"));
        assert!(
            status.success(),
            "collectives.h does not compile alone as {lang}"
        );
        assert!(
            Command::new(&exe).status().unwrap().success(),
            "{lang}: the initializer is not blocking"
        );
    }
}
