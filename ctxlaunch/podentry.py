"""`python3 -m ctxlaunch.podentry SPEC`: the container command of every PyTorchJob pod
(ctxlaunch.contract.rundir.POD_MODULE), kept under its published name; the code is
ctxlaunch.runtime.podentry."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("ctxlaunch.runtime.podentry", run_name="__main__", alter_sys=True)
