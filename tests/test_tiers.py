"""The two tiers: ``pytest -m "not slow"`` (quick) and the default run (both).

tests/conftest.py marks the slow tier; these check that its rules see what they claim to.
"""

import configparser
import pathlib

import conftest

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_the_slow_marker_is_registered():
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    assert config["tool:pytest"]["markers"].strip().startswith("slow:")


def test_a_test_that_starts_a_process_through_a_helper_or_a_fixture_is_slow(tmp_path):
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import subprocess, sys, pytest\n"
        "def _run(*args):\n    return subprocess.run([sys.executable, *args])\n"
        "@pytest.fixture\ndef table():\n    return _run('-c', 'print(1)')\n"
        "def test_direct():\n    subprocess.run(['true'])\n"
        "def test_through_a_helper():\n    _run('-V')\n"
        "def test_through_a_fixture(table):\n    pass\n"
        "class TestInProcess:\n    def test_in_process(self):\n        assert 1\n"
    )
    (tmp_path / "test_user.py").write_text(
        "from test_probe import _run as run\nimport test_probe as probe\n"
        "def test_imported():\n    run()\n"
        "def test_through_the_module():\n    probe._run()\n"
        "def test_in_process():\n    pass\n"
    )
    starters = conftest._process_starters(probe)
    assert {"test_direct", "test_through_a_helper", "test_through_a_fixture"} <= starters
    assert "test_in_process" not in starters
    starters = conftest._process_starters(tmp_path / "test_user.py")
    assert {"test_imported", "test_through_the_module"} <= starters
    assert "test_in_process" not in starters


def test_every_slow_file_and_test_named_exists():
    for name in conftest.SLOW_FILES:
        assert (REPO / "tests" / name).is_file(), name
    for test in conftest.SLOW_TESTS:
        name, function = test.split("::")
        assert f"def {function}(" in (REPO / "tests" / name).read_text(), test
