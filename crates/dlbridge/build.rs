//! Gates platform code in one place: `cfg(cuda)` and `cfg(metal)` are the only switches the
//! sources test, so a backend is compiled in exactly when its feature is on *and* the target can
//! run it.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(cuda)");
    println!("cargo::rustc-check-cfg=cfg(metal)");
    let vendor = std::env::var("CARGO_CFG_TARGET_VENDOR").unwrap_or_default();
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        println!("cargo::rustc-cfg=cuda");
    }
    if std::env::var_os("CARGO_FEATURE_METAL").is_some() && vendor == "apple" {
        println!("cargo::rustc-cfg=metal");
    }
}
