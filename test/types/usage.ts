// Type-checked against the built dist/*.d.ts by test/types.test.ts, importing the package by name.
import { Client, Pool, config, DatabaseError, types, type QueryResult } from 'edgepg'
import edgepg from 'edgepg'
import { createProxy, type ProxyOptions } from 'edgepg/proxy'

config.coalesceWrites = true
config.wsProxy = (host: string, port: number) => `${host}:${port}/v2`

interface User {
  id: number
  name: string
}

export async function usage(): Promise<User[]> {
  const client = new Client({ connectionString: 'postgres://u:p@h/db', useSecureWebSocket: false, wsProxy: 'localhost:8080/v1' })
  await client.connect()
  const res: QueryResult<User> = await client.query<User>('SELECT $1::int AS id, $2 AS name', [1, 'a'])
  client.on('notice', (n) => n.message)
  await client.end()
  const pool = new Pool({ max: 2, coalesceWrites: false, queryViaHttp: true })
  const pc = await pool.connect()
  pc.release()
  await pool.end()
  types.setTypeParser(20, (v: string) => BigInt(v))
  const isDbError = (e: unknown) => e instanceof DatabaseError && e.code === '23505'
  const proxyOptions: ProxyOptions = { upstream: '127.0.0.1:5432', allow: ['127.0.0.1:5433'] }
  const proxy = createProxy(proxyOptions)
  await proxy.close()
  void isDbError
  void new edgepg.Client()
  return res.rows
}

// @ts-expect-error: unknown option names are caught
new Client({ wsProxyy: 'x' })

// ── httpSql (SQL over HTTP) ──────────────────────────────────────────────────────────────────
import { httpSql, HttpQuery, HttpSqlError, type HttpQueryResult, type HttpSqlOptions } from 'edgepg'

export async function httpUsage(): Promise<User[]> {
  const options: HttpSqlOptions = { fetchEndpoint: (host: string, port: number) => `https://${host}:${port}/sql`, authToken: async () => 'jwt', fetchOptions: { signal: AbortSignal.timeout(1000) } }
  const sql = httpSql('postgres://u:p@h/db', options)
  const users: User[] = await sql<User>`SELECT id, name FROM users WHERE id = ${1}`
  const first: string = users[0].name
  const loose: Record<string, any>[] = await sql`SELECT 1 ${sql`WHERE ${sql.unsafe('true')}`}`
  const query: HttpQuery<User[]> = sql<User>`SELECT 1`
  const full: HttpQueryResult<User> = await sql.query<User>('SELECT $1::int AS id', [1], { fullResults: true })
  const fullRow: User = full.rows[0]
  const arrays: any[][] = await sql.query('SELECT 1', [], { arrayMode: true })
  const tuples: [number, string][] = await sql.query<[number, string]>('SELECT 1, $1', ['a'], { arrayMode: true })
  const plain: User[] = await sql.query<User>('SELECT 1')
  const fullSql = httpSql({ connectionString: 'postgres://u:p@h/db', fullResults: true, arrayMode: true, types })
  const r = await fullSql`SELECT 1`
  const rowAsArray: boolean = r.rowAsArray
  const arrayRow: any[] = r.rows[0]
  const rowsOnly: any[][] = await fullSql.query('SELECT 1', [], { fullResults: false })
  const [a, b] = await sql.transaction([sql<User>`SELECT 1`, sql.query('SELECT 2', [], { fullResults: true })], { isolationLevel: 'Serializable', readOnly: true })
  const fromTx: User[] = a
  const fullFromTx: number | null = b.rowCount
  const [c] = await sql.transaction((tx) => [tx<User>`SELECT 1`])
  const anyResults: any[] = await sql.transaction([sql`SELECT 1`], { fullResults: true })
  const isHttpError = (e: unknown) => e instanceof HttpSqlError && e.status === 413
  // @ts-expect-error: rows are typed
  void users[0].nope
  // @ts-expect-error: isolation levels are checked
  void sql.transaction([], { isolationLevel: 'Chaos' })
  // @ts-expect-error: a tagged template, not a function call
  void sql('SELECT 1')
  void [first, loose, query, fullRow, arrays, tuples, plain, rowAsArray, arrayRow, rowsOnly, fromTx, fullFromTx, c, anyResults, isHttpError]
  return users
}
