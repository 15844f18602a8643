package eventline_test

import (
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestTheLibraryModuleDoesNotHoldTheCLI: the eventline command and its
// end-to-end tests are a module of their own (cmd/eventline, as the
// benchmark harness is cmd/eventline-bench), so a service that requires
// the library gets none of them, and the library's packages are what `go
// list ./...` lists in the root. The invariant checker the command runs
// is a library package (admin/verify), which an operator's own code can
// call too.
func TestTheLibraryModuleDoesNotHoldTheCLI(t *testing.T) {
	if testing.Short() {
		t.Skip("runs go list")
	}
	goList := goLister(t)
	packages := goList(".", "./...")
	require.Contains(t, packages, "github.com/eventline/eventline/producer\n", "go list ./... runs in the library module")
	require.Contains(t, packages, "github.com/eventline/eventline/admin/verify\n", "the checker is a library package")
	for _, p := range strings.Fields(packages) {
		require.False(t, strings.HasPrefix(p, "github.com/eventline/eventline/cmd/"), "the library module holds %s", p)
		require.NotContains(t, p, "/internal/verify")
		require.NotContains(t, p, "/internal/e2e")
	}
	require.Equal(t, "github.com/eventline/eventline/cmd/eventline\n", goList("cmd/eventline", "-m"), "cmd/eventline is a module of its own")
	require.NotContains(t, goList(".", "-deps", "./..."), "/cmd/eventline", "no library package imports the command's")
}

// goLister returns a function that runs go list in dir, in that
// directory's module, and fails the test when go list does.
func goLister(t *testing.T) func(dir string, args ...string) string {
	return func(dir string, args ...string) string {
		t.Helper()
		cmd := exec.Command("go", append([]string{"list"}, args...)...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GOWORK=off") // each module with its own go.mod
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "go list %s in %s: %s", strings.Join(args, " "), dir, out)
		return string(out)
	}
}

// TestTheKafkaSuiteNamesPackagesThatExist: .ci/test-kafka lists the
// packages to run against Apache Kafka, in the library's module and in
// the command's. A package that moved would only fail there, at the end
// of CI, after the broker started; here it fails in make test.
func TestTheKafkaSuiteNamesPackagesThatExist(t *testing.T) {
	if testing.Short() {
		t.Skip("runs go list")
	}
	script, err := os.ReadFile(".ci/test-kafka")
	require.NoError(t, err)
	goList := goLister(t)
	for name, dir := range map[string]string{"packages": ".", "cli_packages": "cmd/eventline"} {
		m := regexp.MustCompile(`(?m)^` + name + `=\(\n((?:\t[^\n]*\n)+)\)`).FindSubmatch(script)
		require.NotNil(t, m, ".ci/test-kafka has no %s=( … ) list", name)
		pkgs := strings.Fields(string(m[1]))
		require.NotEmpty(t, pkgs, name)
		goList(dir, pkgs...)
	}
}
