"""A study's results, read and shown: load.py (run directories to DataFrames), derived.py (the tables figures and
notebooks share), figures.py, summary_html.py and tensorboard.py (TensorBoard export).
Imports lab.core, lab.numerics and lab.study; never lab.run or lab.diagnose."""
