package kafkabroker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// templateDir, in the cache, holds a data directory formatted once by
// Kafka's storage tool (kafka.tools.StorageTool format): meta.properties
// (node id 1, a cluster id, a directory id) and the bootstrap metadata
// checkpoint. Nothing in it depends on ports or paths, so every broker
// copies it instead of running the tool (a JVM start) again. Brokers
// started from it share a cluster id; each is a cluster of its own.
const templateDir = "formatted"

// formatStorage fills dataDir with a formatted KRaft data directory.
func formatStorage(ctx context.Context, jars, dataDir string) error {
	cache := filepath.Dir(jars)
	tmpl := filepath.Join(cache, templateDir)
	done := filepath.Join(tmpl, ".done")
	if _, err := os.Stat(done); err != nil {
		unlock, err := lockFile(filepath.Join(cache, "format.lock"))
		if err != nil {
			return err
		}
		err = formatTemplate(ctx, jars, tmpl, done)
		unlock()
		if err != nil {
			return err
		}
	}
	if err := os.CopyFS(dataDir, os.DirFS(filepath.Join(tmpl, "data"))); err != nil {
		return fmt.Errorf("kafkabroker: copy the formatted storage: %w", err)
	}
	return nil
}

func formatTemplate(ctx context.Context, jars, tmpl, done string) error {
	if _, err := os.Stat(done); err == nil {
		return nil // formatted by another process meanwhile
	}
	if err := os.RemoveAll(tmpl); err != nil {
		return fmt.Errorf("kafkabroker: clear %s: %w", tmpl, err)
	}
	data := filepath.Join(tmpl, "data")
	if err := os.MkdirAll(tmpl, 0o755); err != nil {
		return fmt.Errorf("kafkabroker: create %s: %w", tmpl, err)
	}
	// The tool validates a whole broker configuration; only node.id,
	// process.roles and log.dirs end up in what it writes.
	props := strings.Join([]string{
		"process.roles=broker,controller",
		"node.id=1",
		"controller.quorum.voters=1@127.0.0.1:9",
		"controller.listener.names=CONTROLLER",
		"listeners=PLAINTEXT://127.0.0.1:8,CONTROLLER://127.0.0.1:9",
		"log.dirs=" + data,
		"",
	}, "\n")
	propsPath := filepath.Join(tmpl, "format.properties")
	if err := os.WriteFile(propsPath, []byte(props), 0o644); err != nil {
		return fmt.Errorf("kafkabroker: write %s: %w", propsPath, err)
	}
	java, err := javaPath()
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, java, "-Xmx256m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC",
		"-cp", filepath.Join(jars, "*"), "kafka.tools.StorageTool",
		"format", "--cluster-id", randomClusterID(), "--config", propsPath)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("kafkabroker: format the storage (kafka.tools.StorageTool): %w\n%s", err, tail(out, 30))
	}
	if _, err := os.Stat(filepath.Join(data, "meta.properties")); err != nil {
		return fmt.Errorf("kafkabroker: the storage tool wrote no meta.properties: %w", err)
	}
	return os.WriteFile(done, nil, 0o644)
}

// stateDir holds the brokers' directories: os.TempDir()/eventline-kafka.
func stateDir() string { return filepath.Join(os.TempDir(), "eventline-kafka") }

// ownerFile, in a broker's directory, names the process that started the
// broker and the JVM's pid.
const ownerFile = "owner"

// newDir creates a broker directory under stateDir.
func newDir() (string, error) {
	if err := os.MkdirAll(stateDir(), 0o755); err != nil {
		return "", fmt.Errorf("kafkabroker: create %s: %w", stateDir(), err)
	}
	dir, err := os.MkdirTemp(stateDir(), "broker-")
	if err != nil {
		return "", fmt.Errorf("kafkabroker: create a broker directory: %w", err)
	}
	if err := writeOwner(dir, 0); err != nil {
		_ = os.RemoveAll(dir)
		return "", err
	}
	return dir, nil
}

func writeOwner(dir string, jvm int) error {
	s := fmt.Sprintf("%d %d\n", os.Getpid(), jvm)
	if err := os.WriteFile(filepath.Join(dir, ownerFile), []byte(s), 0o644); err != nil {
		return fmt.Errorf("kafkabroker: write %s: %w", ownerFile, err)
	}
	return nil
}

// sweepStale removes the directories of brokers whose owning process is
// gone (killed before its cleanup ran). Their JVMs died with the owner on
// Linux; elsewhere a JVM still running there is killed if it is Kafka's.
func sweepStale() {
	entries, err := os.ReadDir(stateDir())
	if err != nil {
		return
	}
	for _, e := range entries {
		dir := filepath.Join(stateDir(), e.Name())
		b, err := os.ReadFile(filepath.Join(dir, ownerFile))
		if err != nil {
			continue
		}
		f := strings.Fields(string(b))
		if len(f) != 2 {
			continue
		}
		owner, _ := strconv.Atoi(f[0])
		jvm, _ := strconv.Atoi(f[1])
		if owner <= 0 || alive(owner) {
			continue
		}
		if jvm > 0 && alive(jvm) && isKafka(jvm, dir) {
			_ = syscall.Kill(jvm, syscall.SIGKILL)
		}
		_ = os.RemoveAll(dir)
	}
}

func alive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// isKafka reports whether pid runs kafka.Kafka on dir's configuration.
func isKafka(pid int, dir string) bool {
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	return err == nil && strings.Contains(string(cmdline), filepath.Join(dir, "server.properties"))
}

// archiveFile, in the cache, is a class-data sharing archive of the
// classes a broker loads (JDK's AppCDS): with it, the JVM maps them instead
// of loading and verifying them from the jars, and the broker answers about
// a third sooner (3.5 s instead of 5.2 s measured here, 2 busy cores).
const archiveFile = "kafka.jsa"

// classArchive returns the JVM option that uses the archive, or when there
// is none yet, one that writes it when this JVM exits cleanly (into
// dumping, which keepArchive then renames into place).
func classArchive(jars string) (option, dumping string) {
	cache := filepath.Dir(jars)
	final := filepath.Join(cache, archiveFile)
	if fileExists(final) {
		return "-XX:SharedArchiveFile=" + final, ""
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	dumping = filepath.Join(cache, archiveFile+"."+hex.EncodeToString(b[:])+".tmp")
	return "-XX:ArchiveClassesAtExit=" + dumping, dumping
}

// keepArchive moves an archive written at exit into place; a JVM killed
// with SIGKILL wrote none.
func keepArchive(jars, dumping string) {
	if !fileExists(dumping) {
		return
	}
	final := filepath.Join(filepath.Dir(jars), archiveFile)
	if fileExists(final) {
		_ = os.Remove(dumping)
		return
	}
	if err := os.Rename(dumping, final); err != nil {
		_ = os.Remove(dumping)
	}
}
