import textutil

assert textutil.words("Hello, world!") == ["Hello", "world"]
assert textutil.title_case("block diffusion models") == "Block Diffusion Models"
assert textutil.slugify("Hello, World: 2 Models!") == "hello-world-2-models"
print("all tests passed")
