"""Training as a job, from a KFP task or anywhere: what the train and tune-sweep components call.

`common` holds what both share (trainer arguments, the job spec, staging in the workspace,
labels, MLflow environment), `train` runs one training job, `sweep` a study whose trials are
training jobs.
"""
