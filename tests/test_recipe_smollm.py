"""The README's "Your own model" recipe, exactly as written, on the real SmolLM2-135M GGUF, the real pool and the eval
suites (slow: 13 minutes on 2 idle AMD EPYC cores at two torch threads, as CI runs it, the README's measured number;
asserted within twice that).

It runs from a temporary directory laid out like a clone, where ``../shared`` is the shared folder, so every path of the
block resolves as it does for a user and the outputs land in the temporary directory. Asserted: what the recipe
promises (the stages ran; one selection of 8 per task for the proxy and the target; the fine-tuned effect per task; a
``check`` verdict with per-task rows), not quality. The wall time per command and in all is written to
``<tmp>/recipe_seconds.json`` and printed (``-s`` shows it): the number the README's estimate is to be replaced with.
"""
import json

import pytest

from test_progress import largest_gap, lines_to_a_file
from test_readme import check_recipe_outputs, readme_recipe_stated_minutes, run_readme_recipe

pytestmark = pytest.mark.slow


def test_readme_recipe_on_smollm(smollm_gguf, shared_dir, tmp_path, monkeypatch):
    repo = tmp_path / "clone"
    repo.mkdir()
    (tmp_path / "shared").symlink_to(shared_dir)
    assert (repo / ".." / "shared" / "models" / smollm_gguf.name).exists()
    monkeypatch.chdir(repo)
    import os
    import resource

    load_before = os.getloadavg()
    # its output to a file, as under tee (issue 65: 15 gaps over 60 s there): never silent for a minute
    with lines_to_a_file(tmp_path / "recipe.log") as seen:
        seconds = run_readme_recipe(repo)
    worst = largest_gap(seen)
    seconds["largest_gap_s"] = round(worst[0], 1)
    # peak RSS of this process (the recipe runs in it), and the machine's load beside it
    seconds["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    seconds["load_average_before_after"] = [round(load_before[0], 1), round(os.getloadavg()[0], 1)]
    (tmp_path / "recipe_seconds.json").write_text(json.dumps(seconds, indent=2))
    print(f"README recipe on SmolLM2, wall seconds: {json.dumps(seconds)} -> {tmp_path / 'recipe_seconds.json'}")
    # the interval (60 s) plus the heartbeat's 1 s tick and slack for a loaded machine
    assert worst[0] <= 75, (worst, tmp_path / "recipe.log")
    assert not any("\r" in ln for _, ln in seen)  # no bar in the log (Lightning's, GGUF de-quantisation's)
    minutes = readme_recipe_stated_minutes()
    assert seconds["total"] <= 2 * 60 * minutes, (seconds, "README states minutes:", minutes)
    summary = check_recipe_outputs(repo)
    assert summary["target_params"] == 134_515_008
    assert all(v["dropped"] == 0 for who in summary["truncation_dropped"].values() for v in who.values())
