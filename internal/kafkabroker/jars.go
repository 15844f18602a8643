package kafkabroker

import (
	"bytes"
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
)

// pom is the checked-in Maven descriptor that pins Kafka and its runtime
// dependencies.
//
//go:embed pom.xml
var pom []byte

// CacheEnv names an environment variable that, when set, is the directory
// the broker's jars are cached in, instead of .cache/kafka at the root of
// the eventline module (or, outside it, the user's cache directory).
const CacheEnv = "EVENTLINE_KAFKA_CACHE"

// stampFile records, in the cache, the hash of the pom the jars were
// resolved from: a changed pom resolves them again.
const stampFile = "pom.sha256"

// CacheDir returns the directory the jars are cached in: $EVENTLINE_KAFKA_CACHE,
// else .cache/kafka at the root of the eventline module the working
// directory is in, else eventline/kafka in the user's cache directory.
func CacheDir() (string, error) {
	if d := os.Getenv(CacheEnv); d != "" {
		return filepath.Abs(d)
	}
	if root, ok := moduleRoot(); ok {
		return filepath.Join(root, ".cache", "kafka"), nil
	}
	d, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("kafkabroker: no cache directory for the Kafka jars (set %s): %w", CacheEnv, err)
	}
	return filepath.Join(d, "eventline", "kafka"), nil
}

// moduleRoot walks up from the working directory to the eventline
// module's go.mod.
func moduleRoot() (string, bool) {
	dir, err := os.Getwd()
	if err != nil {
		return "", false
	}
	for {
		b, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil && bytes.HasPrefix(bytes.TrimSpace(b), []byte("module github.com/eventline/eventline\n")) {
			return dir, true
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", false
		}
		dir = parent
	}
}

// Jars returns the directory holding Kafka's jars (the classpath is
// dir/*), resolving them with Maven first if the cache is missing or was
// resolved from another pom. Maven runs offline first (the jars may be in
// ~/.m2 already), then online (Maven Central). Concurrent callers, in this
// process or others, wait for one resolution.
func Jars(ctx context.Context) (string, error) {
	cache, err := CacheDir()
	if err != nil {
		return "", err
	}
	want := pomSum()
	jars := filepath.Join(cache, "jars")
	if stamped(cache, want) {
		return jars, nil
	}
	if err := os.MkdirAll(cache, 0o755); err != nil {
		return "", fmt.Errorf("kafkabroker: create the jar cache: %w", err)
	}
	unlock, err := lockFile(filepath.Join(cache, "resolve.lock"))
	if err != nil {
		return "", err
	}
	defer unlock()
	if stamped(cache, want) { // resolved by another process meanwhile
		return jars, nil
	}
	if _, err := exec.LookPath("mvn"); err != nil {
		return "", errNoMaven
	}
	_ = os.Remove(filepath.Join(cache, stampFile))
	// Formatted by, and archived from, the old jars.
	_ = os.RemoveAll(filepath.Join(cache, templateDir))
	_ = os.Remove(filepath.Join(cache, archiveFile))
	if err := os.RemoveAll(jars); err != nil {
		return "", fmt.Errorf("kafkabroker: clear the jar cache: %w", err)
	}
	pomPath := filepath.Join(cache, "pom.xml")
	if err := os.WriteFile(pomPath, pom, 0o644); err != nil {
		return "", fmt.Errorf("kafkabroker: write the pom: %w", err)
	}
	resolve := func(offline bool) ([]byte, error) {
		args := []string{"-q", "-B", "-f", pomPath, "dependency:copy-dependencies", "-DoutputDirectory=" + jars, "-DincludeScope=runtime"}
		if offline {
			args = append([]string{"-o"}, args...)
		}
		cmd := exec.CommandContext(ctx, "mvn", args...)
		cmd.Dir = cache
		return cmd.CombinedOutput()
	}
	if _, err := resolve(true); err != nil {
		if out, err := resolve(false); err != nil {
			return "", fmt.Errorf("kafkabroker: resolve Apache Kafka with Maven (mvn dependency:copy-dependencies, from Maven Central): %w\n%s", err, tail(out, 40))
		}
	}
	if _, err := os.Stat(filepath.Join(jars, "kafka_2.13-"+KafkaVersion+".jar")); err != nil {
		return "", fmt.Errorf("kafkabroker: Maven ran but %s holds no kafka_2.13-%s.jar: %w", jars, KafkaVersion, err)
	}
	if err := os.WriteFile(filepath.Join(cache, stampFile), []byte(want+"\n"), 0o644); err != nil {
		return "", fmt.Errorf("kafkabroker: stamp the jar cache: %w", err)
	}
	return jars, nil
}

// Resolved reports whether the jars are cached, so Start runs no Maven.
func Resolved() bool {
	cache, err := CacheDir()
	if err != nil {
		return false
	}
	return stamped(cache, pomSum())
}

// pomSum is the stamp of jars resolved from pom.
func pomSum() string {
	sum := sha256.Sum256(pom)
	return hex.EncodeToString(sum[:])
}

var errNoMaven = errors.New("kafkabroker: Maven (mvn) is not installed: it resolves Apache Kafka's jars from Maven Central once (apt-get install maven)")

// KafkaVersion is the Apache Kafka version pom.xml pins.
const KafkaVersion = "4.4.0"

func stamped(cache, want string) bool {
	b, err := os.ReadFile(filepath.Join(cache, stampFile))
	return err == nil && strings.TrimSpace(string(b)) == want
}

// lockFile takes an exclusive flock on path, waiting for it.
func lockFile(path string) (unlock func(), err error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("kafkabroker: open %s: %w", path, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("kafkabroker: lock %s: %w", path, err)
	}
	return func() {
		_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
		_ = f.Close()
	}, nil
}

// tail returns the last n lines of out.
func tail(out []byte, n int) string {
	lines := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
