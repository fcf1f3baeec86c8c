"""Loaded by every Python process started with this folder on PYTHONPATH (benchmarks/request_files.py): while the
file $TRACE_FLAG names a window, records the (file, function) of each call into the repo ($TRACE_ROOT), and writes
them to $TRACE_FLAG.<pid>.<window>.json when the window ends."""

import json
import os
import sys
import threading
import time

FLAG, ROOT = os.environ.get("TRACE_FLAG"), os.environ.get("TRACE_ROOT", "")
if FLAG:
    _seen: set = set()
    _state = {"window": ""}

    def _profile(frame, event, arg):
        if event == "call" and _state["window"] and not frame.f_code.co_filename.startswith("<"):
            path = os.path.realpath(frame.f_code.co_filename)
            if path.startswith(ROOT) and "/.venv/" not in path:
                _seen.add((path, frame.f_code.co_name))

    def _watch():
        while True:
            try:
                window = open(FLAG).read().strip()
            except OSError:
                window = ""
            if window != _state["window"]:
                ended, _state["window"] = _state["window"], window
                if ended:
                    with open(f"{FLAG}.{os.getpid()}.{ended}.json", "w") as out:
                        json.dump(sorted(_seen), out)
                _seen.clear()
            time.sleep(0.01)

    threading.Thread(target=_watch, daemon=True).start()
    sys.setprofile(_profile)
    threading.setprofile(_profile)
