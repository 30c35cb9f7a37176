"""The one base of every error a user can cause and fix: a bad setting, a missing file or
piece of a cluster. Its message starts with the setting's name and says what is allowed; the
command line prints it as one line and exits with status 2, without a traceback."""


class KubejaxError(Exception):
    """Bad input or a missing prerequisite; the message names the setting."""


class InfeasibleError(KubejaxError, ValueError):
    """Settings the job's devices cannot run: a mesh they do not make, a memory plan over the
    device's memory (`kubejax.trainer.plan`). A sweep skips such a trial (pruned) instead of
    failing it."""
