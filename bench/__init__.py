"""The benchmark suite (``make bench``): see bench/README.md."""
