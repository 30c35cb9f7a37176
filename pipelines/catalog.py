"""Every compiled pipeline by name (`kubejax compile`, `kubejax run`, `kubejax submit`)."""

from kubejax.pipelines.llm import llm_pipeline
from kubejax.pipelines.yelp import train_eval_pipeline, yelp_pipeline

PIPELINES = {
    "kubejax-yelp": yelp_pipeline,
    "kubejax-train-eval": train_eval_pipeline,
    "kubejax-llm": llm_pipeline,
}
