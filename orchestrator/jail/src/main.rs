//! `tenantvm-jail`: builds one tenant's jail (cgroup, namespaces, chroot, uid, no
//! capabilities) and runs its VMM in it. Started by `tenantvmd`; see docs/jail.md.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(tenantvm_jail::launcher::main_with_args(&args));
}
