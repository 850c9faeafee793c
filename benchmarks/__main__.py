from benchmarks.harness import run

run()
