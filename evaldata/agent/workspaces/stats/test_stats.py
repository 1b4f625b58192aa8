from stats import mean, median

assert median([3, 1, 2]) == 2
assert median([4, 1, 2, 3]) == 2.5
assert mean([2, 4, 6]) == 4, f"mean([2, 4, 6]) = {mean([2, 4, 6])}"
print("all tests passed")
