"""The compiled pipelines and components (`kubejax compile`), shipped as package data."""
