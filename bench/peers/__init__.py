"""Task modules the benchmark's worker processes import: qconsole's, procrastinate's and pgqueuer's."""
