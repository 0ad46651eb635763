"""Reading a finished (or running) run dir: the bottleneck diagnosis and the HTML report."""
