//! Links the guest with `linker.ld` (load address 1 MiB, PT_LOAD + PT_NOTE) when building
//! for the bare-metal target; host builds (unit tests of the parsers) link normally.

fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:rerun-if-changed=linker.ld");
    if std::env::var("TARGET").as_deref() == Ok("x86_64-unknown-none") {
        println!("cargo:rustc-link-arg-bins=-T{dir}/linker.ld");
        println!("cargo:rustc-link-arg-bins=--build-id=none");
        println!("cargo:rustc-link-arg-bins=-znorelro");
        println!("cargo:rustc-link-arg-bins=-znostart-stop-gc");
    }
}
