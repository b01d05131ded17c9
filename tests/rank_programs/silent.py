"""A rank program that exits 0 without calling write_result: launch() must say which rank wrote nothing."""
import argparse

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.parse_args()
print("finished without writing a result")
