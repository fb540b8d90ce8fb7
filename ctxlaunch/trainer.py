"""`python -m ctxlaunch.trainer [SPEC]`: the job-side entry point every rendered script and pod
starts (ctxlaunch.contract.rundir.TRAINER_MODULE), kept under its published name; the trainer
itself is ctxlaunch.runtime.trainer."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("ctxlaunch.runtime.trainer", run_name="__main__", alter_sys=True)
