package model

import (
	"os"
	"testing"

	"github.com/leasehold/leasehold/internal/testskip"
)

// TestMain says at the end when the model went unchecked for want of spin
// or gcc.
func TestMain(m *testing.M) { os.Exit(testskip.Summarize(m).Run()) }
