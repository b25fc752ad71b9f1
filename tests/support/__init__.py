"""Code only tests and benchmarks use (synthetic load generators), kept out of the package."""
