package streamsink

const (
	// DefaultMaxOpenGroups is Config.MaxOpenGroups' default.
	DefaultMaxOpenGroups = 1 << 14
	// MaxOpenGroupsLimit is the largest Config.MaxOpenGroups.
	MaxOpenGroupsLimit = 1 << 20
)
