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
  const pool = new Pool({ max: 2, coalesceWrites: false })
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
