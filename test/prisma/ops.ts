/**
 * What prisma.test.ts asks of Prisma on edgepg, in Node and inside workerd alike (so no node:assert):
 * CRUD, relations, batch and interactive transactions (one rolled back), raw queries, and a unique
 * violation surfacing as P2002. `tag` keeps each run's rows apart. Returns the steps that passed.
 */
function check(ok: unknown, what: string, got?: unknown): asserts ok {
  if (!ok) throw new Error(`${what}${got === undefined ? '' : `: got ${JSON.stringify(got)}`}`)
}

export async function runOps(prisma: any, Prisma: any, tag: string) {
  const steps: string[] = []
  const mail = (name: string) => `${name}-${tag}@example.test`
  const ours = { email: { endsWith: `-${tag}@example.test` } }

  const alice = await prisma.user.create({ data: { email: mail('alice'), name: 'Alice' } })
  check(alice.email === mail('alice') && alice.name === 'Alice', 'create', alice)
  check((await prisma.user.findUnique({ where: { email: mail('alice') } }))?.id === alice.id, 'findUnique')
  check((await prisma.user.update({ where: { id: alice.id }, data: { name: 'Alicia' } })).name === 'Alicia', 'update')
  const many = await prisma.user.findMany({ where: ours })
  check(many.length === 1 && many[0].name === 'Alicia', 'findMany', many)
  await prisma.user.delete({ where: { id: alice.id } })
  check((await prisma.user.findUnique({ where: { id: alice.id } })) === null, 'delete')
  steps.push('crud')

  const bob = await prisma.user.create({
    data: { email: mail('bob'), name: 'Bob', posts: { create: [{ title: 'first', published: true }, { title: 'draft' }] } },
    include: { posts: { orderBy: { id: 'asc' } } },
  })
  check(bob.posts.map((p: any) => `${p.title}:${p.published}`).join() === 'first:true,draft:false', 'nested create with include', bob)
  const posts = await prisma.post.findMany({ where: { author: { email: mail('bob') } }, include: { author: true }, orderBy: { id: 'asc' } })
  check(posts.length === 2 && posts[0].author.name === 'Bob', 'a relation filter, the author included', posts)
  const counted = await prisma.user.findUnique({ where: { id: bob.id }, select: { _count: { select: { posts: true } } } })
  check(counted._count.posts === 2, '_count of a relation', counted)
  steps.push('relations')

  const [carol, dave, n] = await prisma.$transaction([
    prisma.user.create({ data: { email: mail('carol') } }),
    prisma.user.create({ data: { email: mail('dave') } }),
    prisma.user.count({ where: ours }),
  ])
  check(carol.email === mail('carol') && dave.email === mail('dave') && n === 3, 'batch $transaction', { carol, dave, n })
  steps.push('batch transaction')

  const erin = await prisma.$transaction(async (tx: any) => {
    const user = await tx.user.create({ data: { email: mail('erin') } })
    await tx.post.create({ data: { title: 'in a transaction', authorId: user.id } })
    return tx.user.findUnique({ where: { id: user.id }, include: { posts: true } })
  })
  check(erin.posts.length === 1, 'interactive $transaction', erin)
  check((await prisma.user.findUnique({ where: { email: mail('erin') } })) !== null, 'interactive $transaction committed')
  steps.push('interactive transaction')

  const thrown = await prisma
    .$transaction(async (tx: any) => {
      const user = await tx.user.create({ data: { email: mail('frank') } })
      await tx.post.create({ data: { title: `doomed ${tag}`, authorId: user.id } })
      check((await tx.user.count({ where: { email: mail('frank') } })) === 1, 'a row written in the transaction is seen in it')
      throw new Error('boom')
    })
    .then(() => undefined, (err: Error) => err)
  check(thrown?.message === 'boom', 'the callback error comes back', thrown?.message)
  check((await prisma.user.count({ where: { email: mail('frank') } })) === 0, 'the rolled-back user is gone')
  check((await prisma.post.count({ where: { title: `doomed ${tag}` } })) === 0, 'the rolled-back post is gone')
  steps.push('rollback')

  const raw = await prisma.$queryRaw`SELECT ${41}::int + 1 AS n, email FROM "User" WHERE email = ${mail('bob')}`
  check(raw.length === 1 && raw[0].n === 42 && raw[0].email === mail('bob'), '$queryRaw', raw)
  check((await prisma.$queryRawUnsafe('SELECT $1::int * 2 AS d', 21))[0].d === 42, '$queryRawUnsafe')
  check((await prisma.$executeRaw`UPDATE "Post" SET published = true WHERE "authorId" = ${bob.id}`) === 2, '$executeRaw')
  steps.push('raw')

  const duplicate = await prisma.user.create({ data: { email: mail('bob') } }).then(() => undefined, (err: any) => err)
  check(duplicate instanceof Prisma.PrismaClientKnownRequestError, 'a unique violation is a PrismaClientKnownRequestError', String(duplicate))
  check(duplicate.code === 'P2002', 'a unique violation is P2002', duplicate.code)
  steps.push('P2002')

  await prisma.post.deleteMany({ where: { author: ours } })
  check((await prisma.user.deleteMany({ where: ours })).count === 4, 'deleteMany after the error')
  steps.push('cleanup')
  return steps
}
