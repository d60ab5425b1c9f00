// What must NOT type-check once edgepg stands in for Neon. Were its types missing (any), each
// expected error below would go unused, which tsc reports as an error itself.
import { drizzle } from 'drizzle-orm/neon-http'
import { neon, Pool } from '@neondatabase/serverless'

// @ts-expect-error: not a query function
drizzle({ client: 42 })
// @ts-expect-error: a Pool is no query function
drizzle({ client: new Pool() })
// @ts-expect-error: neon() takes a connection string or options
neon(42)
export {}
