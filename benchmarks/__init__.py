"""The lab: what measures this build machine, outside the `ubep` package and its wheel.

`ubep` is the library (and its lean `ubep bench`); this folder holds what explains the
figures this host gives: the host model of the simulator checked against `ubep bench`
(`host`, `hostbench`, `hostchunks`, `cpuwatch`, `validate_host`), the host's own gaps and
timer windows and the tail they alone give a call (`probes`, `timer_windows`,
`host_floor`), the generator of docs/results.md (`results`) and one-off measurement
scripts (`scripts/`).
Run from a checkout's root with the venv: `.venv/bin/python -m benchmarks`.
"""
