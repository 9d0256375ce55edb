"""bench/faults.py renders docs/reliability.md from its saved JSON alone, and says plainly when a
fault did not hold."""
import json
import subprocess
import sys

from conftest import REPO


def test_the_reliability_table_is_rendered_from_the_json_alone(tmp_path):
    doc = {"command": "python bench/faults.py --out docs", "machine": "test machine, 2 cores", "wall_s": 120.0,
           "load": {"start": "load average 0.1", "end": "load average 0.2"},
           "rows": [{"fault": "kill -9 one worker", "how": "SIGKILL", "held": True, "promise": "run finishes",
                     "facts": {"exit_code": 0, "detected_after_s": 0.123456}, "seconds": 10.0},
                    {"fault": "a hung worker", "how": "SIGSTOP", "held": False, "promise": "named in time",
                     "facts": {"exit_code": 1, "reason": "a|b"}, "seconds": 5.0}]}
    saved = tmp_path / "reliability.json"
    saved.write_text(json.dumps(doc))
    result = subprocess.run([sys.executable, f"{REPO}/bench/faults.py", "--render", str(saved)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    md = (tmp_path / "reliability.md").read_text()
    assert "Machine: test machine, 2 cores. Command: `python bench/faults.py --out docs` (2.0 min)." in md
    assert "| kill -9 one worker | SIGKILL | yes | run finishes | exit_code: 0; detected_after_s: 0.123 |" in md
    assert "| a hung worker | SIGSTOP | **no** |" in md and "a/b" in md      # a '|' in a fact cannot break the table
    assert "1 of 2 faults held." in md
