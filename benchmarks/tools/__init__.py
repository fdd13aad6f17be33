"""The tools beside the benchmarks, which measure nothing themselves: the GPU check and its preflight and targets,
the provenance every result carries, the check of the numbers in the docs. Run from the repository root as
`python -m benchmarks.tools.<name>` (the GPU check: `bash benchmarks/tools/gpu_check.sh`)."""
