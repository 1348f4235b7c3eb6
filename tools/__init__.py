"""The project's tools: benches, the report, the demo. Run each from the repository root as a
module, e.g. `python -m tools.bench --smoke`, `python -m tools.report`; the shared pieces (results
schema, output files, the side-by-side runner, the smoke models) are in `tools.harness`."""
