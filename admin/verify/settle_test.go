package verify_test

import (
	"bytes"
	"runtime"
	"testing"
	"time"
)

// settleTimeout bounds settleSarama's wait.
const settleTimeout = 5 * time.Second

// settleSarama wraps a TestMain's m for goleak.VerifyTestMain: after the
// tests, it waits up to 5 s until no goroutine runs in Sarama's consumer
// (a closed consumer's broker goroutines nap 100 ms before they notice and
// exit, and on a loaded machine against Apache Kafka that outlasted
// goleak's own retries: admin/verify's tests failed once in a
// make test-kafka run). A goroutine that is really left behind is still
// there after the wait, and goleak reports it.
func settleSarama(m *testing.M) interface{ Run() int } { return settle{m} }

type settle struct{ m *testing.M }

func (s settle) Run() int {
	code := s.m.Run()
	buf := make([]byte, 1<<20)
	for deadline := time.Now().Add(settleTimeout); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		n := runtime.Stack(buf, true)
		if !bytes.Contains(buf[:n], []byte("github.com/IBM/sarama.(*brokerConsumer)")) &&
			!bytes.Contains(buf[:n], []byte("github.com/IBM/sarama.(*partitionConsumer)")) {
			break
		}
	}
	return code
}
