"""A test plugin (`plugins=[interrupt_plugin]`) that sends a real signal from inside a training
process, for runs started as subprocesses (several local processes among them, where no test code
runs in the children): with RPEG_TEST_SIGNAL=<step>:<SIGNAME> in the environment, process 0 (or
RPEG_TEST_SIGNAL_PROCESS, one that runs the actor update) sends itself the signal at the start of the
actor update of step <step> (0-based), once; with RPEG_TEST_SIGNAL=<step>:<SIGNAME>:boundary, at the
step boundary instead: before that process runs any task of step <step> (the previous step's record
and checkpoint hooks have run; an asynchronous save may still be in flight). RPEG_TEST_SIGNAL_STAMP
names a file that gets the time it was sent. Without the variable it changes nothing (the same
command resumes the run)."""

import os
import signal
import time

spec = os.environ.get("RPEG_TEST_SIGNAL")
if spec:
    import jax

    from rpeg_jax.graph import compile as C
    from rpeg_jax.runtime import executor as E

    _step, _name, *_at = spec.split(":")
    _step, _boundary = int(_step), _at == ["boundary"]
    _where = {"step": None, "fired": False}
    _run_task, _call = E.Executor._run_task, C.CompiledStage.__call__

    def fire():
        _where["fired"] = True
        if jax.process_index() == int(os.environ.get("RPEG_TEST_SIGNAL_PROCESS", "0")):
            if os.environ.get("RPEG_TEST_SIGNAL_STAMP"):  # when it was sent, for tests of fault bounds
                with open(os.environ["RPEG_TEST_SIGNAL_STAMP"], "w") as f:
                    f.write(repr(time.time()))
            os.kill(os.getpid(), getattr(signal, _name))

    def run_task(self, task, threaded):
        _where["step"] = task.step
        if _boundary and task.step == _step and not _where["fired"]:
            fire()
        return _run_task(self, task, threaded)

    def call(self, inputs):
        if not _boundary and _where["step"] == _step and "actor_update" in self.name and not _where["fired"]:
            fire()
        return _call(self, inputs)

    E.Executor._run_task, C.CompiledStage.__call__ = run_task, call
