"""Fingerprints ignore layout and see code; checked on synthetic text and real vLLM files."""
from __future__ import annotations

import textwrap

from hotfix import fingerprint

BASE = textwrap.dedent('''
    class Scheduler:
        def _update_from_kv_xfer_finished(self, out):
            """Docstring."""
            for req_id in out.finished_recving or ():
                assert req_id in self.requests  # the bug report's line
            return None
''')


def test_comments_blank_lines_docstrings_and_line_shifts_do_not_matter():
    shifted = "# backport banner\n" * 10 + BASE.replace('"""Docstring."""', '"""Other\n    text."""')
    shifted = shifted.replace("# the bug report's line", "\n\n# moved comment")
    q = "Scheduler._update_from_kv_xfer_finished"
    assert fingerprint.of_source(shifted, q) == fingerprint.of_source(BASE, q)


def test_one_changed_statement_changes_the_fingerprint():
    changed = BASE.replace("assert req_id in self.requests", "if req_id not in self.requests: continue")
    q = "Scheduler._update_from_kv_xfer_finished"
    assert fingerprint.of_source(changed, q) != fingerprint.of_source(BASE, q)


def test_absent_target_is_none():
    assert fingerprint.of_source(BASE, "Scheduler.get_transfer_results") is None
    assert fingerprint.of_source(BASE, "Nope.method") is None


def test_live_function_matches_its_file(tmp_path, monkeypatch):
    (tmp_path / "modfp.py").write_text(BASE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import modfp

    q = "Scheduler._update_from_kv_xfer_finished"
    assert fingerprint.of_function(modfp.Scheduler._update_from_kv_xfer_finished) == \
        fingerprint.of_file(str(tmp_path / "modfp.py"), q)


# --- the real installed vLLM ---------------------------------------------------------

vllm_root = fingerprint.package_root("vllm")  # the suite runs against a real install (.ci/run)

# Fingerprints of Scheduler._update_from_kv_xfer_finished in the stock wheels.
STOCK = {"258ebbc0d940084d": "0.27.0-0.31.0", "10edd450e3d6daa5": "0.32.0-0.33.0",
         "340177406d94690e": "0.34.0"}


def test_real_scheduler_target_has_a_stock_fingerprint():
    path = fingerprint.module_file("vllm.v1.core.sched.scheduler")
    assert path is not None and path.startswith(vllm_root)
    assert fingerprint.of_file(path, "Scheduler._update_from_kv_xfer_finished") in STOCK


def test_real_scheduler_copy_shifted_like_the_backport_still_matches(tmp_path):
    text = open(fingerprint.module_file("vllm.v1.core.sched.scheduler")).read()
    shifted = "# sm89 backport\n" * 10 + text
    assert fingerprint.of_source(shifted, "Scheduler._update_from_kv_xfer_finished") in STOCK


def test_real_scheduler_copy_with_one_statement_changed_does_not_match():
    text = open(fingerprint.module_file("vllm.v1.core.sched.scheduler")).read()
    assert text.count("assert req_id in self.requests") >= 1
    changed = text.replace("assert req_id in self.requests", "assert req_id in self.requests, req_id", 1)
    assert fingerprint.of_source(changed, "Scheduler._update_from_kv_xfer_finished") not in STOCK
