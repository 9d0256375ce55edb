"""Hostile data set files (bench/hostile_data.py builds them small on disk: nested shared
references in a CIFAR pickle, tar, gzip and zip bombs, a zip directory of half a million entries,
a PNG past Pillow's pixel limit, fifos where files should be, stray labels) are refused in one line
each, within seconds and without the memory they ask for. They are loaded in one child process, so
a reader that hangs or balloons fails the test instead of the suite."""
import os
import sys

from conftest import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))
import hostile_data  # noqa: E402

SECONDS = 20                  # each file; the child as a whole gets the sum
PEAK_RSS_MB = 600             # the child's peak: Python and numpy are about 35 MB of it


def test_hostile_data_files_are_refused_in_one_line_within_bounds(tmp_path):
    specs = hostile_data.build_all(tmp_path)
    records, end = hostile_data.run_child(REPO, list(specs.values()), SECONDS * len(specs))
    assert not end["killed"] and end["exit_code"] == 0, end
    assert end["peak_rss_mb"] < PEAK_RSS_MB, end
    said = {name: record for name, record in zip(specs, records)}
    assert list(said) == list(specs), records
    for name, record in said.items():
        assert record["seconds"] < SECONDS and record["lines"] == 1, (name, record)
        assert record["said"].startswith(specs[name]), (name, record)          # names the file
        if name == "npz-label-10":                                             # a stray label: said, not refused
            assert record["outcome"] == "loaded", record
            assert "11 classes inferred from the labels 0..10; class 10 has 1 training image(s)" in record["said"]
        else:
            assert record["outcome"] == "DataError", (name, record)
    assert "expand to more than" in said["cifar-nested-labels"]["said"]
    assert "expand to more than" in said["cifar-shared-bytes"]["said"]
    assert "an extended header of 268435456 bytes" in said["cifar-pax-header"]["said"]
    assert "more than 256 members" in said["cifar-many-members"]["said"]
    assert "a gzip bomb?" in said["idx-gzip-bomb"]["said"]
    assert "a zip bomb?" in said["npz-zip-bomb"]["said"]
    assert "its zip directory declares" in said["npz-directory"]["said"]
    assert "only 11 distinct labels have training images" in said["npz-label-250"]["said"]
    assert "a decompression bomb: " in said["png-bomb"]["said"] and " a photo may have" in said["png-bomb"]["said"]
    assert "not a regular file" in said["folder-fifo"]["said"] and "not a regular file" in said["data-fifo"]["said"]
