"""Built-in workloads, one module each; each exposes ``build(**options) -> Workload``."""
