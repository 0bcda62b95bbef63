import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))          # lora_files helpers
sys.path.insert(0, str(Path(__file__).parents[1] / "model"))   # model_runs
sys.path.insert(0, str(Path(__file__).parents[1] / "serve"))   # serve_support
