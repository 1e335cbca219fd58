"""Where things are, for tests in any folder of tests/: the repository (ROOT), tests/ itself
(TESTS: its helper modules and toy ops) and the recorded data (DATA)."""
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DATA = TESTS / "data"
