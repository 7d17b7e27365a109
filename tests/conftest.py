import sys
from pathlib import Path

# Test helpers live in tests/support; make them importable as `support`.
sys.path.insert(0, str(Path(__file__).parent))
