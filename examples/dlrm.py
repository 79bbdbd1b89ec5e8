"""DLRM: embedding bags on sparse features, bottom/top MLPs, pairwise dot interactions."""
import sys

from common import single_call_example
import zoo

if __name__ == "__main__":
    model, args = zoo.dlrm()
    sys.exit(single_call_example("dlrm", "DLRM recommender (4 embedding bags, dense 13)", model, args))
